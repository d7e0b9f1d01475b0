"""The GPU source: every GPU's NVML counters into `gpu_samples`, XIDs and lost GPUs into `events`.

Public: `source.GpuSource`; `nvml.Nvml`, the narrow protocol of the NVML calls it makes, with `nvml.RealNvml` (over
pynvml), its errors and NVML's numbers; `owners`, which engine uses a GPU (`ProcPidView`, `EngineLookup`,
`EngineGpus`, `PodGpus`, `used_gpus`). Behind the source: `readings` (one GPU's readings), `health` (which GPUs are
sampled: lost GPUs, rediscovery, the XID event set) and `events` (what it reports besides samples). The fake NVML
for tests is `stepline.testing.fake_nvml`.
"""
