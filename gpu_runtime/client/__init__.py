"""What a server uses to reach a runtime: the socket client and its wire protocol, the poison-pill guard, the GPU
allocation rules, where model files and run files live. Torch-free: `app/` imports this room, `gpu_runtime.contract`
and `gpu_runtime.errors`, and nothing else of the runtime. It imports only the contract, the errors and itself."""
