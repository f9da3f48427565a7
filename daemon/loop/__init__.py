"""The service and what it owns, built by :mod:`daemon.loop.factory`: intake, the wait room,
the actor and the dispatcher, endings, status files, the heartbeat, mail, metrics and systemd
notification. The one imperative shell: the loop's thread alone changes state. Imports every
layer below it, never :mod:`daemon.cli`."""
