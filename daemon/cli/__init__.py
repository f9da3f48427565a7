"""``watchctl``: the operators' and experts' command line. It reads the store directly (so it
works while the daemon is down) and records what it changes as intents the daemon applies.
Imports the contract, the core, the site, the store and the executors (for ``doctor``), never
:mod:`daemon.loop`."""
