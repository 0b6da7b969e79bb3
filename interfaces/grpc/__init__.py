"""The control channel's controller end: gRPC servicer and protobuf bridge."""
