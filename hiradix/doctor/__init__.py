"""``hiradix doctor``: check a planned launch on this machine before the model loads.

One concept per module:

| module        | checks / holds                                                              |
|---------------|-----------------------------------------------------------------------------|
| ``report``    | a check's outcome (ok / warning / error, name, detail, fix), the report    |
| ``install``   | the pinned SGLang is installed; the plugin entry point resolves             |
| ``plan``      | :class:`LaunchPlan`: what the flags mean for this machine (filled by        |
|               | ``hiradix.sglang_plugin.doctor_flags``, the only part that imports SGLang)  |
| ``capacity``  | free RAM and disk against the DRAM and NVMe tiers of this node             |
| ``nvme_dir``  | the NVMe directory: writable, O_DIRECT, KvikIO                              |
| ``persisted`` | existing NVMe directories: fingerprint match (reuse) or discard, and why    |
| ``store``     | the cluster store's master answers within the timeout                      |
| ``cli``       | argument handling, the order of the checks, the exit status                 |

Docs: ``docs/doctor.md``.
"""
