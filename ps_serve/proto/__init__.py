"""Generated code of protos/inference/grpc_service.proto."""
