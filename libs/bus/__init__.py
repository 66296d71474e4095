"""The NATS adapter of the contract in libs.protocol: broker, RPC and events, the JetStream plan stream."""
