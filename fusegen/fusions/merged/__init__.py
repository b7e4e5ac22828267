"""The merged-linear family's machinery: everything the kinds of `fusegen.fusions.linear` share.

One module per job, imports pointing down this list:

- `groups`: the search for groups of sibling `nn.Linear` children whose first call reads the same value;
- `rewrite_init`, `rewrite_nested`: the merged construction in `__init__` (one block, or nested blocks);
- `rewrite_forward`, `rewrite_cross`: the merged call and split in `forward` (one input; or one input in
  self-attention and two in cross-attention);
- `hoist`: the hoisting rules that keep the merged call from reading another value than the calls it replaces;
- `dataflow`: which names may alias the projections' input; `lookup`: what a name denotes;
- `live`: the checks on the instantiated children (exactly `nn.Linear`, no hooks, one dtype and device);
- `rules`: the rule ids and the mutation tests' switch.

The names the rules trust or fear are `fusegen.core.vocabulary`'s.
"""
