"""Device meshes, multi-host start-up and logical-to-mesh sharding."""
