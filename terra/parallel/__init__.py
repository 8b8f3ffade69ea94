"""Device meshes, multi-host start-up and logical-to-mesh sharding."""

from terra.parallel.mesh import make_mesh

__all__ = ["make_mesh"]
