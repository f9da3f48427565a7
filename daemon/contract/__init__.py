"""The contract between the daemon and its jobs: the job spec and its result, problems and
errors, the rules for opening and writing in a batch folder that is its owner's (held folders,
safe opening, atomic files), checksums, the version, and the names and defaults shared with
``models/``. ``pipelines/`` and ``models/`` import this package and nothing else of the daemon;
it imports nothing else of the daemon."""
