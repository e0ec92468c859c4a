"""``python -m gateway`` runs the ``kappa-gateway`` command line."""

from gateway.cli import main

main()
