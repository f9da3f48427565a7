"""The pure core: data in, data out, no clock, filesystem, logging or database. The state
machine, the records the store returns, the manifest and its schema, sweeps, readiness (judging
what a look at the inputs saw), the planner (snapshot + now → actions) and the job plan.
Imports only :mod:`daemon.contract`."""
