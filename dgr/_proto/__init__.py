"""Generated protobuf/gRPC code for proto/dgr.proto (python -m dgr.transport.codegen)."""
