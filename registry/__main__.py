"""`python -m registry`: the same as the `nonomad-registry` console script."""

from registry.main import main

main()
