"""Size overrides that shrink any model config (``sizes/tiny.gin``)."""
