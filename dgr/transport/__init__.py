"""gRPC transport of dgr: the shard service (server side) and its client, over grpcio."""
