"""What the call paths share beyond the kernels: launching compiled Triton kernels without
Triton's per-call dispatch, and recording launches into plans that later calls replay
(`pqattn.runtime.launch`); progress lines for long work on a terminal (`pqattn.runtime.progress`)."""
