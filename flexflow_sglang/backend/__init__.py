"""The SGLang glue: the `flexflow` radix-cache backend.

    plugin.register          `sglang.srt.plugins` entry point (registers backend + scheduler hooks)
    plugin.build_tree_cache  the RadixCacheFactory (delegation / refusal rules)
    cache.FlexFlowRadixCache RadixCache + host tier through the connector
    rank_sync.RankSync       MIN agreement over attention-CP/TP groups, PP forward

Nothing here is imported by `import flexflow_sglang`; SGLang is imported lazily.
"""
