"""ps-serve: one ONNX model behind the Open Inference Protocol (KServe v2), over HTTP and gRPC.

One module per concern (docs/serving.md has the whole story):

    cli.py           the `ps-serve` command: arguments, the READY line, signals, exit status 2 for bad arguments
    server.py        the composition root: InferenceServer (HTTP, and gRPC when asked), BackgroundServer (in a thread)
    model.py         the served model: ModelState (session, step, weights; immutable), ServedModel (current, swap)
    tensors.py       the protocol's datatypes and the checked decoding and encoding of tensors (JSON, raw bytes)
    http.py          the REST API on aiohttp, with Triton's binary tensor data extension
    grpc_service.py  inference.GRPCInferenceService: health, metadata, ModelInfer
    security.py      the bind rule, TLS, the bearer token
    metrics.py       Prometheus metrics at /metrics
    errors.py        the errors a request can get, each with its status
    proto/           the gRPC messages generated from protos/inference/grpc_service.proto
"""
