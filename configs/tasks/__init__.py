"""Task configs: ``TASK``, ``TASK_FEATURE_LENGTHS`` and ``FEATURE_CONVERTER`` of each seqio task."""
