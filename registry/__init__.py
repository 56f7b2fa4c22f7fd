"""registry ("our Corrosion"): the replica of every worker's machines that flaps and proxy embed.

`view` is the replica's state without I/O, `replica` the loops that keep it (`Replica`),
`service` the RegistryService every replica-embedding service serves, `main` the standalone
registry, and `fakes` a fake worker for tests and benchmarks.
"""
