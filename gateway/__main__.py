"""``python -m gateway`` runs the ``kappa-gateway`` command line."""

from gateway.commands.cli import main

main()
