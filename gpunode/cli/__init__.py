"""The command line: typer wiring and rendering only; the work lives in the modules it calls."""
