"""``python -m terra.convert trax ...``: the ``terra-convert`` command (:mod:`terra.cli.convert`)."""

from terra.cli.convert import main

raise SystemExit(main())
