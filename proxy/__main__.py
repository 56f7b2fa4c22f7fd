"""`python -m proxy`: the same as the `nonomad-proxy` console script."""

from proxy.main import main

main()
