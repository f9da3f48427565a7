"""The site and the machine the daemon runs on: the configuration, access checks, subprocesses,
the database lock and the drop roots' leases, mounts, logging. Imports the contract and the
core."""
