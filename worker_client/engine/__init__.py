"""The gradient engine, one module per stage of its pipeline."""
