"""registry: the replica of every worker's machines that flaps and proxy embed."""
