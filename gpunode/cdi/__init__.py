"""CDI (Container Device Interface): the spec gpunode writes for the node's GPUs, and its checks.

`spec` holds the format (names, the minimum cdiVersion, rendering); `hostfacts` reads what the spec points
at on the host (device nodes, the driver's libraries through the linker cache, firmware, sockets); `generate`
builds and writes the spec from NVML's inventory; `registry` reads every spec directory the runtimes read;
`check` compares a written spec with the node as it is now.
"""
