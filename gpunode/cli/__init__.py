"""The command line: click wiring and rendering only; the work lives in the modules it calls."""
