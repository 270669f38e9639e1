"""The parameter server: shards, optimizers and the gRPC service."""
