"""``python -m lbkit`` runs the command-line tool."""

if __name__ == "__main__":
    from lbkit.cli import main

    raise SystemExit(main())
