"""Everything terra does with gin, one module per job (docs/architecture.md, "gin names,
registered in one place"): ``registration`` registers every configurable; ``registry_file`` and
``registry.json`` store their selectors and parameters for the checks made before heavy imports;
``reading`` reads gin text without importing what it names; ``override_checks`` checks a
command's ``--gin`` overrides; ``parsing`` parses files and bindings and builds macros; ``frozen``
keeps a built model's gin-injected layers at the values they were built with.

Import the module you need; this package imports none of them, so reading and checking gin text
loads neither JAX nor TensorFlow.
"""
