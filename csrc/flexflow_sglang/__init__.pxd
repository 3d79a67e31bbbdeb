# Marks csrc/flexflow_sglang as the Cython package of flexflow_sglang's compiled modules.
