"""Hand-written modules where fusion is safe (fused, same outputs) or wrong (refused, with the rule).

Each case is a tiny causal LM of its own (config, block, model, head) written
to a module file and compiled through the same path as a Transformers model
type: `fusegen build <dotted module path>`.
"""

import importlib

import pytest
import torch

from fusegen.compiler.build import analyse, build
from fusegen.testkit import TOY_HELPERS, TOY_NARROW_LOOP, toy_source
from fusegen.tools import oracle
from fusegen.tools.oracle import Toy

QKV = "        q = self.q_proj(x)\n        k = self.k_proj(x)\n        v = self.v_proj(x)\n"
RETURN = "        return q + torch.cat([k, v], dim=-1)\n"
GLU_INIT = """
        self.gate_proj = nn.Linear(config.hidden_size, 24, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, 24, bias=False)
        self.down_proj = nn.Linear(24, config.hidden_size, bias=False)
        self.act = nn.SiLU()
"""

# name: (extra __init__ lines, forward body)
SAFE = {
    "plain": ("", QKV + RETURN),
    "reversed_glu_operands": (
        GLU_INIT,
        QKV + "        h = self.up_proj(x) * self.act(self.gate_proj(x))\n"
        "        return q + torch.cat([k, v], dim=-1) + self.down_proj(h)\n",
    ),
    "guard_is_not_none": (
        "",
        "        q = self.q_proj(x)\n        k = self.k_proj(x)\n"
        "        v = self.v_proj(x) if self.v_proj is not None else torch.zeros_like(k)\n" + RETURN,
    ),
    "guard_none_first": (
        "",
        "        q = self.q_proj(x)\n        k = self.k_proj(x)\n        v = torch.zeros_like(k)\n"
        "        if None is not self.v_proj:\n            v = self.v_proj(x)\n" + RETURN,
    ),
    "guard_is_none_else": (
        "",
        "        q = self.q_proj(x)\n        k = self.k_proj(x)\n"
        "        if self.v_proj is None:\n            v = torch.zeros_like(k)\n"
        "        else:\n            v = self.v_proj(x)\n" + RETURN,
    ),
    "guard_truthiness": (
        "",
        "        q = self.q_proj(x)\n        k = self.k_proj(x)\n        v = 0\n"
        "        if self.v_proj:\n            v = self.v_proj(x)\n" + RETURN,
    ),
    "guard_not": (
        "",
        "        q = self.q_proj(x)\n        k = self.k_proj(x)\n"
        "        v = torch.zeros_like(k) if not self.v_proj else self.v_proj(x)\n" + RETURN,
    ),
    "config_flag_branches": (
        "",
        "        q = self.q_proj(x)\n"
        "        if self.flag:\n            k = self.k_proj(x) * 2\n            v = self.v_proj(x)\n"
        "        else:\n            k = torch.zeros(x.shape[:-1] + (8,))\n            v = torch.ones_like(k)\n"
        + RETURN,
    ),
    "qk_norm": (
        "        self.q_norm = nn.LayerNorm(16)\n        self.k_norm = nn.LayerNorm(8)\n",
        "        q = self.q_norm(self.q_proj(x))\n        k = self.k_norm(self.k_proj(x))\n        v = self.v_proj(x)\n"
        + RETURN,
    ),
    "inplace_on_outputs": (
        "",
        "        q = self.q_proj(x)\n        q.mul_(2)\n        k = self.k_proj(x)\n        k.add_(q[..., :8])\n"
        "        v = self.v_proj(x)\n        torch.relu_(v)\n" + RETURN,
    ),
    "keyword_and_spelling_variants": (
        (
            "        self.a_proj = nn.Linear(in_features=self.hidden_size, out_features=4, bias=False)\n"
            "        self.b_proj = nn.Linear(config.hidden_size, 2 * 2, False)\n"
        ),
        QKV
        + "        return q + torch.cat([k, v], dim=-1) + torch.cat([self.a_proj(x), self.b_proj(x)] * 2, dim=-1)\n",
    ),
    "unwritten_view_alias": (
        "",
        (
            "        q = self.q_proj(x)\n        h = x.view(-1, self.hidden_size)\n        n = h.sum()\n"
            "        k = self.k_proj(x)\n        v = self.v_proj(x)\n"
            "        return q + torch.cat([k, v], dim=-1) + n\n"
        ),
    ),
    "metadata_between": (
        "",
        (
            "        q = self.q_proj(x)\n        batch, length, width = x.shape\n        size = x.size(-1)\n"
            "        k = self.k_proj(x)\n        v = self.v_proj(x)\n"
            "        return q + torch.cat([k, v], dim=-1) * (size // width)\n"
        ),
    ),
    "mutation_outside_region": (
        "",
        "        x = x * 2\n" + QKV + "        x.mul_(3)\n        return q + torch.cat([k, v], dim=-1) + x\n",
    ),
    "generic_merged_column": (
        (
            "        self.a_gate = nn.Linear(config.hidden_size, 4, bias=True)\n"
            "        self.b_gate = nn.Linear(config.hidden_size, 12, bias=True)\n"
        ),
        QKV + "        g = torch.cat([self.a_gate(x), torch.sigmoid(self.b_gate(x))], dim=-1)\n"
        "        return q * g + torch.cat([k, v], dim=-1)\n",
    ),
    "temporary_names_taken": (
        "",
        "        q_proj_out = 1.0\n" + QKV + "        return q * q_proj_out + torch.cat([k, v], dim=-1)\n",
    ),
    "pure_module_on_input": (
        "        self.act = nn.GELU()\n",
        (
            "        q = self.q_proj(x)\n        a = self.act(x)\n        k = self.k_proj(x)\n        v = self.v_proj(x)\n"
            "        return q + a + torch.cat([k, v], dim=-1)\n"
        ),
    ),
    # A projection built under a condition merges with its sibling where it exists; elsewhere the sibling stays.
    "conditional_sibling": (
        (
            "        self.a_proj = nn.Linear(config.hidden_size, 4, bias=False) if config.flag else None\n"
            "        self.b_proj = nn.Linear(config.hidden_size, 4, bias=False)\n"
        ),
        QKV
        + "        a = self.a_proj(x) if self.a_proj is not None else x[..., :4]\n"
        + "        return q + torch.cat([k, v], dim=-1) + torch.cat([a, self.b_proj(x)] * 2, dim=-1)\n",
    ),
    # Differing bias flags merge with a per-piece flag list (the b rows of the merged bias are zero and inert).
    "bias_flags_differ": (
        (
            "        self.a_proj = nn.Linear(config.hidden_size, 4, bias=True)\n"
            "        self.b_proj = nn.Linear(config.hidden_size, 4, bias=False)\n"
        ),
        QKV
        + "        return q + torch.cat([k, v], dim=-1) + torch.cat([self.a_proj(x), self.b_proj(x)] * 2, dim=-1)\n",
    ),
}

# name: (extra __init__ lines, forward body, expected rule)
HAZARDS = {
    "rebound_between": (
        "",
        (
            "        q = self.q_proj(x)\n        x, y = x, x * 2\n        k = self.k_proj(x)\n        v = self.v_proj(x)\n"
            "        return q + torch.cat([k, v], dim=-1) + y\n"
        ),
        "input-rebound",
    ),
    "item_written": (
        "",
        "        q = self.q_proj(x)\n        x[0] = 0\n        k = self.k_proj(x)\n        v = self.v_proj(x)\n"
        + RETURN,
        "input-written",
    ),
    "view_alias_written": (
        "",
        "        h = x.view(-1)\n        q = self.q_proj(x)\n        h[0] = 5.0\n        k = self.k_proj(x)\n"
        "        v = self.v_proj(x)\n" + RETURN,
        "input-written",
    ),
    "slice_alias_inplace": (
        "",
        "        q = self.q_proj(x)\n        h = x[:, 1:]\n        h.add_(1)\n        k = self.k_proj(x)\n"
        "        v = self.v_proj(x)\n" + RETURN,
        "inplace-call",
    ),
    "transpose_chain_inplace": (
        "",
        "        q = self.q_proj(x)\n        h = x.transpose(1, 2)\n        g = h[0]\n        g.zero_()\n"
        "        k = self.k_proj(x)\n        v = self.v_proj(x)\n" + RETURN,
        "inplace-call",
    ),
    "unpacked_alias_inplace": (
        "",
        "        q = self.q_proj(x)\n        a, b = x.chunk(2, dim=-1)\n        a.mul_(0)\n        k = self.k_proj(x)\n"
        "        v = self.v_proj(x)\n" + RETURN,
        "inplace-call",
    ),
    "method_inplace": (
        "",
        "        q = self.q_proj(x)\n        x.mul_(2)\n        k = self.k_proj(x)\n        v = self.v_proj(x)\n"
        + RETURN,
        "inplace-call",
    ),
    "function_inplace": (
        "",
        "        q = self.q_proj(x)\n        torch.relu_(x)\n        k = self.k_proj(x)\n        v = self.v_proj(x)\n"
        + RETURN,
        "inplace-call",
    ),
    "out_keyword": (
        "",
        "        q = self.q_proj(x)\n        torch.add(x, 1, out=x)\n        k = self.k_proj(x)\n        v = self.v_proj(x)\n"
        + RETURN,
        "inplace-call",
    ),
    "inplace_keyword": (
        "",
        "        q = self.q_proj(x)\n        F.relu(x, inplace=True)\n        k = self.k_proj(x)\n        v = self.v_proj(x)\n"
        + RETURN,
        "inplace-call",
    ),
    "inplace_submodule": (
        "        self.act = nn.ReLU(inplace=True)\n",
        "        q = self.q_proj(x)\n        self.act(x)\n        k = self.k_proj(x)\n        v = self.v_proj(x)\n"
        + RETURN,
        "impure-call",
    ),
    "mutating_user_module": (
        "        self.mutate = Mutator()\n",
        "        q = self.q_proj(x)\n        self.mutate(x)\n        k = self.k_proj(x)\n        v = self.v_proj(x)\n"
        + RETURN,
        "impure-call",
    ),
    "mutating_function": (
        "",
        "        q = self.q_proj(x)\n        scale_in_place(x)\n        k = self.k_proj(x)\n        v = self.v_proj(x)\n"
        + RETURN,
        "impure-call",
    ),
    "state_method_between": (
        "        self.register_buffer('state', torch.zeros(1))\n",
        "        q = self.q_proj(x)\n        self.reset_state()\n        k = self.k_proj(x)\n        v = self.v_proj(x)\n"
        + RETURN,
        "state-method-call",
    ),
    "called_twice": (
        "",
        "        q = self.q_proj(x) + self.q_proj(x)\n        k = self.k_proj(x)\n        v = self.v_proj(x)\n"
        + RETURN,
        "not-called-once",
    ),
    "call_in_loop": (
        "",
        "        q = 0\n        for _ in range(2):\n            q = q + self.q_proj(x)\n"
        "        k = self.k_proj(x)\n        v = self.v_proj(x)\n" + RETURN,
        "call-in-loop",
    ),
    "weight_referenced": (
        "",
        "        q = self.q_proj(x) * self.q_proj.weight.mean()\n        k = self.k_proj(x)\n        v = self.v_proj(x)\n"
        + RETURN,
        "escaping-reference",
    ),
    "passed_as_object": (
        "",
        "        q = apply(self.q_proj, x)\n        k = self.k_proj(x)\n        v = self.v_proj(x)\n" + RETURN,
        "not-called-once",
    ),
    "equality_guard_not_folded": (
        "",
        "        q = self.q_proj(x)\n        k = self.k_proj(x)\n"
        "        v = self.v_proj(x) if self.v_proj != None else k\n" + RETURN,
        "escaping-reference",
    ),
    "inputs_spelled_differently": (
        "",
        "        y = x\n        q = self.q_proj(x)\n        k = self.k_proj(y)\n        v = self.v_proj(x)\n" + RETURN,
        "different-inputs",
    ),
    # A projection built under a condition: the condition must mean the same where the merged linear is built.
    "conditional_guard_changes": (
        (
            "        self.a_proj = nn.Linear(config.hidden_size, 4, bias=False) if self.flag else None\n"
            "        self.flag = not self.flag\n"
            "        self.b_proj = nn.Linear(config.hidden_size, 4, bias=False)\n"
        ),
        QKV
        + "        a = self.a_proj(x) if self.a_proj is not None else x[..., :4]\n"
        + "        return q + torch.cat([k, v], dim=-1) + torch.cat([a, self.b_proj(x)] * 2, dim=-1)\n",
        "constructor-inputs-change",
    ),
    "conditional_guards_differ": (
        (
            "        self.a_proj = nn.Linear(config.hidden_size, 4, bias=False) if config.flag else None\n"
            "        self.b_proj = nn.Linear(config.hidden_size, 4, bias=False) if config.hidden_size > 8 else None\n"
        ),
        QKV
        + "        a = self.a_proj(x) if self.a_proj is not None else x[..., :4]\n"
        + "        b = self.b_proj(x) if self.b_proj is not None else x[..., :4]\n"
        + "        return q + torch.cat([k, v], dim=-1) + torch.cat([a, b] * 2, dim=-1)\n",
        "unusual-init",
    ),
    "name_mangled": (
        "        self.__scale = 2.0\n",
        QKV + "        return q * self.__scale + torch.cat([k, v], dim=-1)\n",
        "name-mangled",
    ),
    "merged_name_taken": (
        "        self.qkv_proj = None\n",
        QKV + RETURN,
        "name-clash",
    ),
}


def between(*lines, before=(), after=(), ret=RETURN):
    """A forward calling q, then `lines`, then k and v; `before` runs ahead of q, `after` after v."""
    indent = "".join("        " + line + "\n" for statement in (*before,) for line in statement.split("\n"))
    middle = "".join("        " + line + "\n" for statement in lines for line in statement.split("\n"))
    tail = "".join("        " + line + "\n" for statement in after for line in statement.split("\n"))
    return (
        indent
        + "        q = self.q_proj(x)\n"
        + middle
        + "        k = self.k_proj(x)\n        v = self.v_proj(x)\n"
        + tail
        + ret
    )


# name: (extra __init__ lines, forward body, expected rule, module-level lines, ToyLayer.__init__ lines)
FAMILY_HAZARDS = {
    # a callee that is not a statically resolvable name or dotted attribute, or is bound to the input
    "callee_bound_method": ("", between("op = x.mul_", "op(2.0)"), "unknown-callee", "", ""),
    "callee_bound_before": ("", between("op(2.0)", before=["op = x.mul_"]), "unknown-callee", "", ""),
    "callee_ifexp": ("", between("(x.mul_ if self.flag else x.mul)(2.0)"), "unknown-callee", "", ""),
    "callee_getattr": ("", between('getattr(x, "mul_")(2.0)'), "unknown-callee", "", ""),
    "callee_list": ("", between("fns[0](1.0)", before=["fns = [x.add_]"]), "unknown-callee", "", ""),
    "callee_dict": ("", between('ops["m"](2.0)', before=['ops = {"m": x.mul_}']), "unknown-callee", "", ""),
    "callee_local_lambda": ("", between("f(x)", before=["f = lambda t: t.mul_(2.0)"]), "unknown-callee", "", ""),
    "callee_immediate_lambda": ("", between("(lambda t: t.mul_(2.0))(x)"), "unknown-callee", "", ""),
    "callee_chained_view": ("", between("x.view(-1).mul_(2)"), "inplace-call", "", ""),
    # augmented assignment on a possible alias is an in-place write
    "augassign_view": ("", between("h = x.view(-1)", "h *= 2"), "aliased-augassign", "", ""),
    "augassign_detach": ("", between("d = x.detach()", "d += 1"), "aliased-augassign", "", ""),
    "augassign_slice": ("", between("h -= 1", before=["h = x[:, 1:]"]), "aliased-augassign", "", ""),
    "augassign_chunk": ("", between("a, b = x.chunk(2, dim=-1)", "b /= 2"), "aliased-augassign", "", ""),
    "augassign_chain": (
        "",
        between("g **= 2", before=["h = x.transpose(1, 2)", "g = h[0]"]),
        "aliased-augassign",
        "",
        "",
    ),
    "augassign_walrus": ("", between("(h := x.view(-1))", "h += 1"), "aliased-augassign", "", ""),
    # reflection reaches any name of the frame
    "reflection_eval": ("", between('eval("x.mul_(2)")'), "reflection", "", ""),
    "reflection_exec": ("", between('exec("x.add_(1)")'), "reflection", "", ""),
    "reflection_locals": ("", between('locals()["x"].add_(1)'), "reflection", "", ""),
    "reflection_vars": ("", between('vars()["x"].mul_(0.5)'), "reflection", "", ""),
    "reflection_eval_alias": ("", between('e("x.mul_(2)")', before=["e = eval"]), "reflection", "", ""),
    "reflection_getframe": ("", between('sys._getframe(0).f_locals["x"].mul_(2)'), "reflection", "", ""),
    "reflection_currentframe": ("", between('inspect.currentframe().f_locals["x"].add_(1)'), "reflection", "", ""),
    "reflection_globals": ("", between('globals()["scale_in_place"](x)'), "reflection", "", ""),
    # in-place operator functions and dunders
    "operator_iadd": ("", between("operator.iadd(x, 1)"), "inplace-operator", "", ""),
    "operator_imul_imported": ("", between("imul(x, 3)"), "inplace-operator", "from operator import imul", ""),
    "operator_setitem": ("", between("operator.setitem(x, 0, 0.0)"), "inplace-operator", "", ""),
    "operator_itruediv": ("", between("operator.itruediv(x, 2)"), "inplace-operator", "", ""),
    "dunder_iadd": ("", between("x.__iadd__(1)"), "inplace-operator", "", ""),
    "dunder_setitem": ("", between("x.__setitem__(0, 0.0)"), "inplace-operator", "", ""),
    "dunder_on_view": ("", between("h = x.view(-1)", "h.__imul__(2)"), "inplace-operator", "", ""),
    "setattr_data": ("", between('setattr(x, "data", x * 2)'), "dynamic-attribute", "", ""),
    # the input stored where the alias analysis cannot follow it
    "escape_self_attribute": ("", between("self.saved.mul_(2)", before=["self.saved = x"]), "input-escapes", "", ""),
    "escape_global_list": ("", between("CACHE[-1].mul_(2)", before=["CACHE.append(x)"]), "input-escapes", "", ""),
    "escape_keeper_module": (
        "        self.keeper = Keeper()\n",
        between("self.keeper.kept.mul_(2)", before=["self.keeper(x)"]),
        "input-escapes",
        "",
        "",
    ),
    "opaque_local_list": (
        "",
        between("cache[0].mul_(2)", before=["cache = []", "cache.append(x)"]),
        "opaque-alias",
        "",
        "",
    ),
    "opaque_user_object": ("", between("obj.view()", before=["obj = Box(x)"]), "opaque-alias", "", ""),
    # code written before the region that runs inside it
    "deferred_def": ("", between("bump()", before=["def bump():\n    x.add_(1)"]), "deferred-capture", "", ""),
    "deferred_lambda": ("", between("g()", before=["g = lambda: x.mul_(2)"]), "deferred-capture", "", ""),
    "deferred_generator": (
        "",
        between("next(gen)", before=["gen = (t.mul_(2) for t in [x])"]),
        "deferred-capture",
        "",
        "",
    ),
    # helpers that reach the caller's frame
    "frame_getframe_helper": ("", between("poke()"), "frame-access", "", ""),
    "frame_helper_alias": ("", between("p()", before=["p = poke"]), "frame-access", "", ""),
    "frame_inspect_helper": ("", between("poke_inspect()"), "frame-access", "", ""),
    "frame_transitive_helper": ("", between("outer_helper()"), "frame-access", "", ""),
    # rebinding the input, in every binding form
    "rebound_walrus": ("", between("(x := x)"), "input-rebound", "", ""),
    "rebound_for": ("", between("for x in [x]:\n    pass"), "input-rebound", "", ""),
    "rebound_import": (
        "",
        between("from torch import tensor as x", "x = x_saved", before=["x_saved = x"]),
        "input-rebound",
        "",
        "",
    ),
    "hook_forward": (
        "",
        QKV + RETURN,
        "projection-hook",
        "",
        "        self.block.k_proj.register_forward_hook(lambda m, i, o: o * 2)",
    ),
    "hook_pre": (
        "",
        QKV + RETURN,
        "projection-hook",
        "",
        "        self.block.v_proj.register_forward_pre_hook(lambda m, i: (i[0] * 2,))",
    ),
    "hook_loop": (
        "",
        QKV + RETURN,
        "projection-hook",
        "",
        TOY_NARROW_LOOP + "                module.register_forward_hook(lambda m, i, o: o * 2)",
    ),
    "hook_backward": (
        "",
        QKV + RETURN,
        "projection-hook",
        "",
        "        self.block.q_proj.register_full_backward_hook(lambda m, gi, go: None)",
    ),
    "hook_instance_forward": (
        "",
        QKV + RETURN,
        "projection-hook",
        "",
        "        self.block.k_proj.forward = lambda t: t[..., :8] * 0",
    ),
    "hook_global": (
        "",
        QKV + RETURN,
        "global-hook",
        "_HOOKS = [torch.nn.modules.module.register_module_forward_hook(lambda m, i, o: None)]",
        "",
    ),
    "hook_global_pre": (
        "",
        QKV + RETURN,
        "global-hook",
        "_HOOKS = [torch.nn.modules.module.register_module_forward_pre_hook(lambda m, i: None)]",
        "",
    ),
    "subclass_with_forward": (
        "",
        QKV + RETURN,
        "linear-subclass",
        "",
        "        self.block.k_proj = Scaled(16, 8, bias=False)",
    ),
    "subclass_without_forward": (
        "",
        QKV + RETURN,
        "linear-subclass",
        "",
        "        self.block.q_proj = PlainSubclass(16, 16, bias=False)",
    ),
    "subclass_in_init": (
        "        self.v_proj = Scaled(config.hidden_size, 8, bias=False)\n",
        QKV + RETURN,
        "linear-subclass",
        "",
        "",
    ),
    "parametrized": (
        "",
        QKV + RETURN,
        "parametrized-projection",
        "",
        "        torch.nn.utils.parametrize.register_parametrization(self.block.k_proj, 'weight', Double())",
    ),
    "parametrized_loop": (
        "",
        QKV + RETURN,
        "parametrized-projection",
        "",
        TOY_NARROW_LOOP
        + "                torch.nn.utils.parametrize.register_parametrization(module, 'weight', Double())",
    ),
    "dtype_mismatch": ("", QKV + RETURN, "dtype-mismatch", "", "        self.block.k_proj.to(torch.float64)"),
    "dtype_mismatch_half": ("", QKV + RETURN, "dtype-mismatch", "", "        self.block.v_proj.half()"),
}

# name: (extra __init__ lines, forward body, module-level lines, ToyLayer.__init__ lines)
FAMILY_SAFE = {
    "detach_read_only": ("", between("d = x.detach()", "n = d.sum()", "m = d.view(-1).max()"), "", ""),
    "metadata_reads": (
        "",
        between("n = x.ndim + x.numel() + len(x)", "t = x.dtype", "w = x.device", 's = getattr(x, "shape")'),
        "",
        "",
    ),
    "pure_torch_calls": (
        "",
        between(
            "y = torch.cat([x, x], dim=-1).sum()",
            "z = F.silu(x) + torch.sigmoid(x)",
            "w = torch.matmul(x, x.transpose(-1, -2))",
            "u = F.dropout(x, 0.0, False)",
        ),
        "",
        "",
    ),
    "keyword_input": (
        "",
        "        q = self.q_proj(input=x)\n        k = self.k_proj(input=x)\n        v = self.v_proj(x)\n" + RETURN,
        "",
        "",
    ),
    "alias_rebound_not_augmented": ("", between("h = x.view(-1)", "h = h * 2"), "", ""),
    "int_augassign": ("", between("n = x.shape[0]", "n += 1"), "", ""),
    "pure_operator_functions": ("", between("y = operator.add(x, 1)", "z = operator.getitem(x, 0)"), "", ""),
    "pure_dunders": ("", between("y = x.__getitem__(0)", "z = x.__add__(1)"), "", ""),
    "lambda_not_capturing": ("", between("y = f(3)", before=["f = lambda t: t * 2"]), "", ""),
    "helper_without_frames": ("", between("n = harmless_helper()"), "", ""),
    "inplace_before_the_projections": ("", between(before=["x = x * 1", "x.mul_(2)"]), "", ""),
    "unrelated_hook": (
        "        self.act = nn.GELU()\n",
        between(ret="        return self.act(q) + torch.cat([k, v], dim=-1)\n"),
        "",
        "        self.block.act.register_forward_hook(lambda m, i, o: o * 2)",
    ),
    "subclass_elsewhere": (
        "        self.o_proj = Scaled(config.hidden_size, config.hidden_size, bias=False)\n",
        between(ret="        return self.o_proj(q) + torch.cat([k, v], dim=-1)\n"),
        "",
        "",
    ),
}


def write_case(tmp_path, name, init, forward, extra="", layer=""):
    package = tmp_path / "hazard_cases"
    package.mkdir(exist_ok=True)
    (package / "__init__.py").touch()
    module_name = f"toy_{name}"
    (package / f"{module_name}.py").write_text(toy_source(module_name, init, forward, extra, layer))
    return f"hazard_cases.{module_name}"


def outcome(dotted):
    (block,) = [o for o in analyse(dotted).outcomes if o.class_name == "ToyBlock"]
    return block


def assert_fused_computes_the_same(case_path, tmp_path, dotted, name):
    """Build the case, then under `flag` True and False: the fused causal LM, loaded from the original's checkpoint
    with no key left over or missing, gives the original's logits."""
    (case_path / "hazard_cases" / f"fused_{name}.py").write_text(build(dotted, validate=False).text)
    original_module = importlib.import_module(dotted)
    fused_module = importlib.import_module(f"hazard_cases.fused_{name}")
    for flag in (True, False):
        torch.manual_seed(0)
        original = original_module.ToyForCausalLM(original_module.ToyConfig(flag=flag)).eval()
        checkpoint = tmp_path / f"checkpoint-{flag}"
        original.save_pretrained(checkpoint)
        fused, info = fused_module.FusedToyForCausalLM.from_pretrained(checkpoint, output_loading_info=True)
        assert not any(info.values()), info
        input_ids = torch.randint(0, 32, (2, 5), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            expected = original(input_ids).logits
            actual = fused.eval()(input_ids).logits
        assert torch.allclose(expected, actual, atol=1e-6, rtol=0), (expected - actual).abs().max()


ALL_HAZARDS = {
    **{name: (init, forward, rule, "", "") for name, (init, forward, rule) in HAZARDS.items()},
    **FAMILY_HAZARDS,
}
ALL_SAFE = {**{name: (init, forward, "", "") for name, (init, forward) in SAFE.items()}, **FAMILY_SAFE}


def assert_refused_with(block, rule):
    """The block's q/k/v group is refused with `rule`, naming a reason and a line; say what happened otherwise."""
    outcomes = (
        f"refused: {[refusal.describe() for refusal in block.refused]}; fused: {[p.describe() for p in block.fused]}"
    )
    matching = [refusal for refusal in block.refused if refusal.rule == rule]
    assert matching, f"expected a refusal by {rule!r}; {outcomes}"
    refusal = matching[0]
    assert refusal.reason, f"the {rule!r} refusal gives no reason; {outcomes}"
    assert refusal.projections not in [plan.projections for plan in block.fused], outcomes
    return refusal


@pytest.mark.parametrize("name", sorted(ALL_HAZARDS))
def test_hazard_is_refused_with_its_rule(case_path, name):
    init, forward, rule, extra, layer = ALL_HAZARDS[name]
    block = outcome(write_case(case_path, name, init, forward, TOY_HELPERS + "\n" + extra, layer))
    refusal = assert_refused_with(block, rule)
    if rule not in PROJECTION_RULES:
        assert refusal.line, f"the {rule!r} refusal names no source line: {refusal.describe()}"


PROJECTION_RULES = {"projection-hook", "global-hook", "linear-subclass", "parametrized-projection", "dtype-mismatch"}
"""Rules judged on the instantiated modules, which have no source line."""


OVER_REFUSED: dict[str, str] = {}
"""Safe cases the analysis refuses today (docs/analysis.md, "Safe patterns still refused"); strict, so the day a rule
learns to accept one, the test says so."""


@pytest.mark.slow  # 30 builds, each saved, loaded and run
@pytest.mark.parametrize(
    "name",
    [
        (
            pytest.param(name, marks=pytest.mark.xfail(strict=True, reason=OVER_REFUSED[name]))
            if name in OVER_REFUSED
            else name
        )
        for name in sorted(ALL_SAFE)
    ],
)
def test_safe_case_is_fused_and_computes_the_same(case_path, tmp_path, name):
    init, forward, extra, layer = ALL_SAFE[name]
    dotted = write_case(case_path, name, init, forward, TOY_HELPERS + "\n" + extra, layer)
    block = outcome(dotted)
    assert ("q_proj", "k_proj", "v_proj") in [plan.projections for plan in block.fused], block.refused
    assert not block.refused, block.refused
    assert_fused_computes_the_same(case_path, tmp_path, dotted, name)


def test_pieces_on_different_devices_are_refused():
    from torch import nn

    from fusegen.fusions.merged.live import projection_findings

    block = nn.Module()
    block.q_proj, block.k_proj = nn.Linear(4, 4), nn.Linear(4, 2)
    block.k_proj.to("meta")
    rules = [refusal.rule for refusal in projection_findings(block, ("q_proj", "k_proj"))]
    assert rules == ["device-mismatch"], rules


def test_a_subclassed_piece_leaves_its_plain_siblings_fused(case_path):
    # q is subclassed; k and v still merge. (With k subclassed, q + v is refused: `self.k_proj(x)` runs between them.)
    init, forward, _rule, _extra, layer = FAMILY_HAZARDS["subclass_without_forward"]
    block = outcome(write_case(case_path, "subclass_siblings", init, forward, TOY_HELPERS, layer))
    assert [plan.projections for plan in block.fused] == [("k_proj", "v_proj")], block
    assert [refusal.rule for refusal in block.refused] == ["linear-subclass"], block.refused


def test_generic_group_gets_a_merged_column_plan(case_path):
    init, forward = SAFE["generic_merged_column"]
    block = outcome(write_case(case_path, "generic_merged_column", init, forward))
    kinds = {plan.merged: plan.kind for plan in block.fused}
    assert kinds == {"qkv_proj": "qkv", "ab_gate": "merged_column"}


def test_refusal_names_the_source_line(case_path):
    init, forward, _ = HAZARDS["method_inplace"]
    dotted = write_case(case_path, "method_inplace", init, forward)
    (refusal,) = outcome(dotted).refused
    source = importlib.import_module(dotted).__file__
    with open(source) as handle:
        line = handle.read().splitlines()[refusal.line - 1]
    assert line.strip() == "x.mul_(2)"


def test_refusals_appear_in_the_generated_header(case_path):
    forward = QKV + (
        "        a = self.a_proj(x)\n        x.mul_(2)\n        b = self.b_proj(x)\n"
        "        return q + torch.cat([k, v], dim=-1) + torch.cat([a, b] * 2, dim=-1)\n"
    )
    init = "        self.a_proj = nn.Linear(16, 4)\n        self.b_proj = nn.Linear(16, 4)\n"
    text = build(write_case(case_path, "mixed", init, forward), validate=False).text
    header = text.split('"""')[0]
    assert "FusedToyBlock: q_proj + k_proj + v_proj -> qkv_proj (qkv)" in header
    assert "ToyBlock: a_proj + b_proj: inplace-call: `x.mul_(2)` writes the projection input in place" in header
    assert "self.a_proj(x)" in text and "self.b_proj(x)" in text


def test_module_that_does_not_import_is_an_input_error():
    from fusegen.errors import InputError

    with pytest.raises(InputError, match="cannot import module 'no_such_pkg.modeling'"):
        analyse("no_such_pkg.modeling")


def test_module_without_causal_lm_is_an_input_error(case_path):
    from fusegen.errors import InputError

    (case_path / "plain_pkg").mkdir()
    (case_path / "plain_pkg" / "__init__.py").touch()
    (case_path / "plain_pkg" / "modeling_plain.py").write_text("X = 1\n")
    with pytest.raises(InputError, match="defines no causal-LM classes"):
        analyse("plain_pkg.modeling_plain")


def test_kv_fused_when_q_reads_another_spelling(case_path, tmp_path):
    # The cross-attention-capable shape: k and v read `current`, which is `x` only when self-attending.
    forward = (
        "        q = self.q_proj(x)\n"
        "        current = x if self.flag else x.flip(1)\n"
        "        k = self.k_proj(current)\n        v = self.v_proj(current)\n" + RETURN
    )
    dotted = write_case(case_path, "cross_style", "", forward)
    block = outcome(dotted)
    assert [(plan.kind, plan.merged) for plan in block.fused] == [("merged_column", "kv_proj")]
    assert [refusal.rule for refusal in block.refused] == ["different-inputs"]
    assert_fused_computes_the_same(case_path, tmp_path, dotted, "cross_style")


def test_conditional_sibling_merges_only_where_it_is_built(case_path):
    """`a_proj` exists only when `flag`: where it does, a + b are one merged linear; where it does not, `b_proj`
    stays a plain linear under its own name (the SAFE case `conditional_sibling` runs both for equivalence)."""
    init, forward = SAFE["conditional_sibling"]
    dotted = write_case(case_path, "conditional_plan", init, forward, TOY_HELPERS)
    block = outcome(dotted)
    assert ("merged_column", "ab_proj", ("b_proj",)) in [(p.kind, p.merged, p.kept) for p in block.fused]
    (case_path / "hazard_cases" / "fused_conditional_plan.py").write_text(build(dotted, validate=False).text)
    original_module = importlib.import_module(dotted)
    fused_module = importlib.import_module("hazard_cases.fused_conditional_plan")
    built = fused_module.FusedToyForCausalLM(original_module.ToyConfig(flag=True)).model.layers[0].block
    assert built.ab_proj.output_sizes == [4, 4] and built.b_proj is None
    plain = fused_module.FusedToyForCausalLM(original_module.ToyConfig(flag=False)).model.layers[0].block
    assert plain.ab_proj is None and type(plain.b_proj) is torch.nn.Linear


def _through(binding, write):
    """q, k and v read `z`, bound by `binding` from a name `write` changes between q and k."""
    return (
        "        y = x * 1\n        a = x * 3\n"
        + "".join(f"        {line}\n" for line in binding.split("\n"))
        + f"        q = self.q_proj(z)\n        {write}\n        k = self.k_proj(z)\n        v = self.v_proj(z)\n"
        + RETURN
    )


SOURCE_HAZARDS = {
    # name: (forward, rule): a write through a name the projection input was bound FROM reaches the input
    "source_plain": (_through("z = y", "y.mul_(2)"), "inplace-call"),
    "source_view": (_through("z = y.view(2, -1, 16)", "y.mul_(2)"), "inplace-call"),
    "source_conditional": (_through("z = a if self.flag else y", "y[0] = 0"), "input-written"),
    "source_chain": (_through("w = y[0:]\nz = w", "y += 1"), "aliased-augassign"),
    "source_parameter": (_through("z = x", "x.add_(1)"), "inplace-call"),
}


@pytest.mark.parametrize("name", sorted(SOURCE_HAZARDS))
def test_write_through_a_source_of_the_input_is_refused(case_path, name):
    forward, rule = SOURCE_HAZARDS[name]
    block = outcome(write_case(case_path, name, "", forward))
    refusal = assert_refused_with(block, rule)
    assert refusal.line, refusal.describe()


def test_write_through_a_source_between_k_and_v_is_refused(case_path):
    # The cross-attention shape: k and v read `current`, bound from `other`, which is written between them.
    forward = (
        "        other = x.flip(1)\n"
        "        q = self.q_proj(x)\n"
        "        current = other if self.flag else x\n"
        "        k = self.k_proj(current)\n        other.mul_(2)\n        v = self.v_proj(current)\n" + RETURN
    )
    block = outcome(write_case(case_path, "source_cross", "", forward))
    assert_refused_with(block, "inplace-call")
    assert not block.fused, [plan.describe() for plan in block.fused]


STATE_HAZARDS = {
    # name: forward: the projection input is bound from a tensor attribute of `self`, written between q and k
    "state_plain": _through("self.kept = y * 1\nz = self.kept", "self.kept.mul_(2)"),
    "state_view": _through("self.kept = y * 1\nz = self.kept.view(2, -1, 16)", "self.kept.mul_(2)"),
    "state_conditional": _through(
        "self.kept = y * 1\nz = self.kept if self.training else self.kept.flip(0)", "self.kept[0] = 0"
    ),
}


@pytest.mark.parametrize("name", sorted(STATE_HAZARDS))
def test_an_input_bound_from_module_state_is_refused(case_path, name):
    block = outcome(write_case(case_path, name, "", STATE_HAZARDS[name]))
    refusal = assert_refused_with(block, "state-source")
    assert refusal.line, refusal.describe()


def test_an_input_scaled_by_a_plain_attribute_still_fuses(case_path):
    # `self.scale` holds a float: reading it into the input gives the input no storage of the module's.
    forward = (
        "        z = x * self.scale\n"
        + "".join(f"        {c}\n" for c in ("q = self.q_proj(z)", "k = self.k_proj(z)", "v = self.v_proj(z)"))
        + RETURN
    )
    block = outcome(write_case(case_path, "state_plain_scale", "        self.scale = 0.5\n", forward))
    assert [plan.merged for plan in block.fused] == ["qkv_proj"], [r.describe() for r in block.refused]


def test_an_input_bound_from_module_state_fuses_when_nothing_writes_state(case_path):
    forward = (
        "        self.kept = x * 1\n        z = self.kept\n"
        "        q = self.q_proj(z)\n        k = self.k_proj(z)\n        v = self.v_proj(z)\n" + RETURN
    )
    block = outcome(write_case(case_path, "state_unwritten", "", forward))
    assert [plan.merged for plan in block.fused] == ["qkv_proj"], [r.describe() for r in block.refused]


def test_an_input_returned_by_a_method_is_refused_when_a_callee_is_handed_self(case_path):
    # `self.pick()` may return `self.kept`; `poke_state(self)` may write it between q and k.
    forward = _through("self.kept = y * 1\nz = self.pick()", "poke_state(self)")
    extra = "\n\ndef poke_state(block):\n    block.kept.mul_(2)\n"
    block = outcome(
        write_case(case_path, "state_method", "        self.pick = lambda: self.kept\n", forward, extra=extra)
    )
    assert_refused_with(block, "state-source")


# --- third batch: ambient context, caller-side aliasing, projection identity, pieces, argument writes ------------------
#
# Every case is a toy block whose forward is judged by an oracle of its own (`fusegen.tools.oracle.verdict`), not by
# the build's validation: when the analysis fuses the block, the fused causal LM runs against the original, with the same
# weights, in fp32, under each value of the forward-only `flag`, in eval mode and in train mode (logits and every
# gradient), each with and without bf16 autocast. A hazard must be refused or fused soundly (no difference, no
# failure where the original runs); a safe twin must be fused and agree.


def _pair(name: str) -> str:
    return f"self.block.register_forward_pre_hook(lambda m, args: (args[0], {name}))"


_Q, _K, _V = "q = self.q_proj(x)", "k = self.k_proj(x)", "v = self.v_proj(x)"
_LAYER = "        "

NEW_HAZARDS = {
    # 1. ambient numerics and autograd state
    "ctx_no_grad_around_k": Toy((_Q, "with torch.no_grad():\n    " + _K, _V)),
    "ctx_inference_mode_around_q": Toy(("with torch.inference_mode():\n    " + _Q, "q = q.clone()", _K, _V)),
    "ctx_grad_switched_by_call": Toy(
        (_Q, "was = torch.is_grad_enabled()", "torch.set_grad_enabled(False)", _K, "torch.set_grad_enabled(was)", _V)
    ),
    "ctx_set_grad_enabled_with": Toy((_Q, _K, "with torch.set_grad_enabled(False):\n    " + _V)),
    "ctx_enable_grad_observed": Toy(
        (_Q, "with torch.enable_grad():\n    " + _K, "k = k * 2 if k.requires_grad else k", _V)
    ),
    "ctx_autocast_around_v": Toy(
        (_Q, _K, 'with torch.autocast("cpu", dtype=torch.bfloat16):\n    ' + _V),
        ret="return q + torch.cat([k, v.float()], dim=-1)",
    ),
    "ctx_amp_autocast_keywords": Toy(
        (_Q, 'with torch.amp.autocast(device_type="cpu", dtype=torch.bfloat16):\n    ' + _K + "\n    " + _V),
        ret="return q + torch.cat([k, v], dim=-1).float()",
    ),
    "ctx_autocast_via_exitstack": Toy(
        (
            _Q,
            "with contextlib.ExitStack() as stack:\n"
            '    stack.enter_context(torch.autocast("cpu", dtype=torch.bfloat16))\n    ' + _K,
            _V,
        ),
        ret="return q + torch.cat([k.float(), v], dim=-1)",
    ),
    "ctx_autocast_forward_flag": Toy(
        (_Q, 'with torch.autocast("cpu", dtype=torch.bfloat16, enabled=not self.flag):\n    ' + _K, _V),
        ret="return q + torch.cat([k.float(), v], dim=-1)",
    ),
    "ctx_autocast_disabled_for_q": Toy(
        ('with torch.autocast("cpu", enabled=False):\n    ' + _Q, _K, _V),
        ret="return q + torch.cat([k, v], dim=-1).to(q.dtype)",
    ),
    "ctx_saved_tensor_hooks": Toy((_Q, "with torch.autograd.graph.saved_tensors_hooks(keep, halve):\n    " + _K, _V)),
    "ctx_function_mode": Toy((_Q, _K, "with Doubling():\n    " + _V)),
    "ctx_dispatch_mode": Toy((_Q, "with Rounding():\n    " + _K, _V)),
    "ctx_mode_entered_by_call": Toy(
        (_Q, "mode = Doubling()", "mode.__enter__()", _K, "mode.__exit__(None, None, None)", _V)
    ),
    # 2. aliasing made by the caller
    "alias_param_inplace": Toy((_Q, "y.mul_(2.0)", _K, _V), layer=_LAYER + _pair("args[0]"), signature="x, y"),
    "alias_param_augassign": Toy((_Q, "y += 1.0", _K, _V), layer=_LAYER + _pair("args[0]"), signature="x, y"),
    "alias_param_item_store": Toy((_Q, "y[..., 0] = 0.0", _K, _V), layer=_LAYER + _pair("args[0]"), signature="x, y"),
    "alias_param_out": Toy(
        (_Q, "torch.mul(y, 2.0, out=y)", _K, _V), layer=_LAYER + _pair("args[0]"), signature="x, y"
    ),
    "alias_varargs": Toy((_Q, "rest[0].add_(1.0)", _K, _V), layer=_LAYER + _pair("args[0]"), signature="x, *rest"),
    "alias_kwargs": Toy(
        (_Q, 'extra["mirror"].mul_(0.5)', _K, _V),
        layer=_LAYER
        + "self.block.register_forward_pre_hook(lambda m, args, kwargs: (args, {'mirror': args[0]}), with_kwargs=True)",
        signature="x, **extra",
    ),
    "alias_list_param": Toy(
        (_Q, "states[0].sub_(1.0)", _K, _V), layer=_LAYER + _pair("[args[0]]"), signature="x, states"
    ),
    "alias_cache_object": Toy(
        (_Q, "cache.view()", _K, _V), layer=_LAYER + _pair("Box(args[0])"), signature="x, cache"
    ),
    "alias_primed_attribute": Toy(
        (_Q, "self.mirror.mul_(2.0)", _K, _V),
        layer=_LAYER + "self.block.register_forward_pre_hook(lambda m, args: setattr(m, 'mirror', args[0]))",
    ),
    "alias_global_registry": Toy(
        (_Q, "REGISTRY[-1].mul_(2.0)", _K, _V),
        layer=_LAYER + "self.block.register_forward_pre_hook(lambda m, args: REGISTRY.append(args[0]))",
    ),
    "alias_helper_without_arguments": Toy(
        (_Q, "bump_registered()", _K, _V),
        layer=_LAYER + "self.block.register_forward_pre_hook(lambda m, args: REGISTRY.append(args[0]))",
    ),
    "alias_closure_cell": Toy(
        (_Q, "scale_cell()", _K, _V),
        layer=_LAYER + "self.block.register_forward_pre_hook(lambda m, args: put_in_cell(args[0]))",
    ),
    "alias_lambda_capturing_parameter": Toy(
        ("f = lambda: cache.view()", _Q, "f()", _K, _V), layer=_LAYER + _pair("Box(args[0])"), signature="x, cache"
    ),
    "alias_lambda_calling_registry_helper": Toy(
        ("f = lambda: bump_registered()", _Q, "f()", _K, _V),
        layer=_LAYER + "self.block.register_forward_pre_hook(lambda m, args: REGISTRY.append(args[0]))",
    ),
    "alias_lambda_rebound": Toy(
        ("f = lambda: 1.0", "if self.flag:\n    f = lambda: bump_registered()", _Q, "n = f()", _K, _V),
        layer=_LAYER + "self.block.register_forward_pre_hook(lambda m, args: REGISTRY.append(args[0]))",
    ),
    "alias_lambda_writing_argument": Toy(
        ("f = lambda t: t.mul_(2.0)", _Q, "f(y)", _K, _V), layer=_LAYER + _pair("args[0]"), signature="x, y"
    ),
    # 3. projections reached without the spelled `self.<proj>`
    "ident_modules_dict": Toy(
        (_Q, 'w = self._modules["k_proj"].weight.sum()', _K, _V), ret="return q * w + torch.cat([k, v], dim=-1)"
    ),
    "ident_getattr_computed": Toy(
        (_Q, 'which = "v" + "_proj"', "w = getattr(self, which).weight.sum()", _K, _V),
        ret="return q * w + torch.cat([k, v], dim=-1)",
    ),
    "ident_attrgetter": Toy(
        (_Q, 'w = operator.attrgetter("k_proj.weight")(self).sum()', _K, _V),
        ret="return q * w + torch.cat([k, v], dim=-1)",
    ),
    "ident_get_submodule": Toy(
        (_Q, 'w = self.get_submodule("v_proj").weight.sum()', _K, _V),
        ret="return q * w + torch.cat([k, v], dim=-1)",
    ),
    "ident_callee_handed_self": Toy((_Q, "w = peek(self)", _K, _V), ret="return q * w + torch.cat([k, v], dim=-1)"),
    "ident_property": Toy(
        (_Q, "w = self.k_rows", _K, _V),
        members="    @property\n    def k_rows(self):\n        return self.k_proj.out_features\n",
        ret="return q * w + torch.cat([k, v], dim=-1)",
    ),
    "ident_parameters": Toy(
        (_Q, "rows = next(self.parameters()).shape[0]", _K, _V), ret="return q * rows + torch.cat([k, v], dim=-1)"
    ),
    "ident_children_count": Toy(
        (_Q, "n = len(list(self.children()))", _K, _V), ret="return q * n + torch.cat([k, v], dim=-1)"
    ),
    "ident_hook_registered_in_forward": Toy(
        (
            _Q,
            "handle = torch.nn.modules.module.register_module_forward_hook(double_plain_linears)",
            _K,
            _V,
            "handle.remove()",
        )
    ),
    # 4. pieces that must behave as the original's projection outputs
    "piece_to_user_function": Toy((_Q, _K, "k = scale_in_place(k)", _V)),
    "piece_inplace_activation": Toy(
        (_Q, _K, "v = self.act_ip(self.v_proj(x))"), init="        self.act_ip = nn.ReLU(inplace=True)\n"
    ),
    "piece_viewed_flat": Toy(
        (_Q, "k = self.k_proj(x).view(-1)", _V), ret="return q + torch.cat([k.view(v.shape), v], dim=-1)"
    ),
    "piece_viewed_rows": Toy(
        (_Q, _K, _V, "flat = v.view(v.shape[0], -1)"), ret="return q + torch.cat([k, flat.view(v.shape)], dim=-1)"
    ),
    "piece_kept_by_user_module": Toy(
        (_Q, "k = self.keeper(self.k_proj(x))", _V, "self.keeper.kept.add_(1.0)"),
        init="        self.keeper = Keeper()\n",
    ),
    "piece_escapes_to_hook": Toy(
        (_Q, _K, _V, "self.seen = k"),
        layer=_LAYER + "self.block.register_forward_hook(lambda m, args, out: [m.seen.mul_(2.0)] and None)",
    ),
    # 5. trusted operations that write their arguments
    "write_embedding_max_norm": Toy(
        (_Q, "rows = F.embedding(torch.tensor([0, 1]), x[0], max_norm=0.1)", _K, _V),
        ret="return q + torch.cat([k, v], dim=-1) + rows.sum()",
    ),
    "write_embedding_bag_max_norm": Toy(
        (_Q, "rows = F.embedding_bag(torch.tensor([[0, 1]]), x[0], max_norm=0.1)", _K, _V),
        ret="return q + torch.cat([k, v], dim=-1) + rows.sum()",
    ),
    "write_batch_norm_running_stats": Toy(
        (_Q, "n = F.batch_norm(x.reshape(-1, 16), x[0, 0], x[0, 1], training=True, momentum=0.5)", _K, _V),
        ret="return q + torch.cat([k, v], dim=-1) + n.sum()",
    ),
    "write_through_data_ptr": Toy((_Q, "clear_at(x.data_ptr())", _K, _V)),
    "write_through_address_name": Toy((_Q, "address = x.data_ptr()", "clear_at(address)", _K, _V)),
}

NEW_SAFE = {
    "ctx_all_under_no_grad": Toy(("with torch.no_grad():\n    " + _Q + "\n    " + _K + "\n    " + _V,)),
    "ctx_all_under_autocast": Toy(
        ('with torch.autocast("cpu", dtype=torch.bfloat16):\n    ' + _Q + "\n    " + _K + "\n    " + _V,),
        ret="return (q + torch.cat([k, v], dim=-1)).float()",
    ),
    "ctx_profiler_label_between": Toy((_Q, 'with torch.profiler.record_function("kv"):\n    ' + _K, _V)),
    "ctx_closed_no_grad_between": Toy(
        (_Q, "with torch.no_grad():\n    n = x.abs().amax()", _K, _V), ret="return q + torch.cat([k, v], dim=-1) + n"
    ),
    "ctx_closed_set_grad_enabled_between": Toy(
        (_Q, "with torch.set_grad_enabled(not self.flag):\n    n = x.abs().amax()", _K, _V),
        ret="return q + torch.cat([k, v], dim=-1) + n",
    ),
    "ctx_grad_mode_read_between": Toy(
        (_Q, "on = torch.is_grad_enabled()", _K, _V), ret="return q + torch.cat([k, v], dim=-1) * (2.0 if on else 1.0)"
    ),
    "alias_param_only_read": Toy(
        (_Q, "n = y.sum()", _K, _V),
        layer=_LAYER + _pair("args[0]"),
        signature="x, y: torch.Tensor",
        ret="return q + torch.cat([k, v], dim=-1) + n",
    ),
    "fresh_empty_like_filled": Toy(
        (_Q, "buf = torch.empty_like(x)", "buf.fill_(0.5)", _K, _V), ret="return q + torch.cat([k, v], dim=-1) + buf"
    ),
    "fresh_zeros_like_accumulated": Toy(
        (_Q, "acc = torch.zeros_like(x)", "acc += x", _K, _V), ret="return q + torch.cat([k, v], dim=-1) + acc"
    ),
    "fresh_full_like_item_store": Toy(
        (_Q, "m = torch.full_like(x, 2.0)", "m[0] = 1.0", _K, _V), ret="return q * m + torch.cat([k, v], dim=-1)"
    ),
    "fresh_new_empty_copied": Toy(
        (_Q, "t = x.new_empty(x.shape)", "t.copy_(x)", "t.mul_(2.0)", _K, _V),
        ret="return q + torch.cat([k, v], dim=-1) + t",
    ),
    "ident_plain_attribute": Toy(
        (_Q, "s = self.hidden_size / 16", _K, _V), ret="return q * s + torch.cat([k, v], dim=-1)"
    ),
    "ident_getattr_constant_flag": Toy(
        (_Q, 'f = getattr(self, "flag")', _K, _V), ret="return q * (2.0 if f else 1.0) + torch.cat([k, v], dim=-1)"
    ),
    "piece_reshaped_flat": Toy(
        (_Q, "k = self.k_proj(x).reshape(-1)", _V), ret="return q + torch.cat([k.view(v.shape), v], dim=-1)"
    ),
    "piece_viewed_as_heads": Toy(
        (_Q, "k = self.k_proj(x).view(x.shape[0], x.shape[1], 2, 4)", _V),
        ret="return q + torch.cat([k.flatten(2), v], dim=-1)",
    ),
    "write_embedding_plain": Toy(
        (_Q, "rows = F.embedding(torch.tensor([0, 1]), x[0])", _K, _V),
        ret="return q + torch.cat([k, v], dim=-1) + rows.sum()",
    ),
    "write_batch_norm_no_stats": Toy(
        (_Q, "n = F.batch_norm(x.reshape(-1, 16), None, None, training=True)", _K, _V),
        ret="return q + torch.cat([k, v], dim=-1) + n.sum()",
    ),
    "lambda_reading_globals_only": Toy(
        ("f = lambda s: torch.ones(16) * s", _Q, "n = f(2.0)", _K, _V), ret="return q + torch.cat([k, v], dim=-1) + n"
    ),
    "write_data_ptr_compared": Toy(
        (_Q, "same = x.data_ptr() == x.data_ptr()", _K, _V),
        ret="return q * (1.0 if same else 2.0) + torch.cat([k, v], dim=-1)",
    ),
}


def write_toy(case_path, name: str, toy: Toy) -> str:
    """Write `toy` as module `hazard_cases.toy_<name>`."""
    return oracle.write_toy(case_path, "hazard_cases", f"toy_{name}", toy)


def _verdict(case_path, dotted: str, name: str, validate: bool) -> str:
    """`refused`, `sound`, or what went wrong when the fused model ran (`fusegen.tools.oracle.verdict`)."""
    return oracle.verdict(dotted, f"fused_{name}_{'v' if validate else 'a'}", validate)


# --- fourth batch: the same families, spellings the third batch and the fuzzer do not use --------------------------
#
# Judged as the third batch is (`fusegen.tools.oracle.verdict`, by running, in every mode), with the module-level code of
# `fusegen.tools.oracle.FOURTH_HELPERS` (`Toy.extra`): objects whose special methods switch grad mode or write what they
# hold, generators and decorators that switch state when advanced or applied, torch's own state functions under other
# names, an input subclass that overrides `F.linear`, and records that carry a piece out of forward.


_F = oracle.FOURTH_HELPERS
_TOGGLE = "sw = Toggle()"
_KT, _VT = "ret_k = k", "ret_v = v"


def _flip_around_k(spelling: str, before: tuple = (_TOGGLE,)) -> Toy:
    """A case whose `spelling` runs once between q and k and once between k and v."""
    return Toy((*before, _Q, spelling, _K, spelling, _V), extra=_F)


def _sly(*lines: str) -> Toy:
    """`cache` is the caller's `Sly` holding the input; `lines` run between q and k."""
    return Toy((_Q, *lines, _K, _V), layer=_LAYER + _pair("Sly(args[0])"), signature="x, cache", extra=_F)


_HASHY = """
class Hashy:
    \"\"\"Holds a tensor; hashing it doubles the tensor in place.\"\"\"

    def __init__(self, t):
        self.t = t

    def __hash__(self):
        self.t.mul_(2.0)
        return 1
"""


def _hashed(line: str) -> Toy:
    """`cache` is the caller's `Hashy` holding the input; `line`, between q and k, hashes it (a set member, a key)."""
    layer = _LAYER + _pair("Hashy(args[0])")
    return Toy((_Q, line, _K, _V), layer=layer, signature="x, cache", extra=_F + _HASHY)


def _rebound(line: str, rebinding: str = "cache = other") -> Toy:
    """`cache` narrowed to a Transformers cache by `isinstance`, then rebound in the branch (by `rebinding`) to the
    caller's `Sly` holding the input (`other`), which `line` (in the branch) hands to its special methods or calls."""
    return Toy(
        (_Q, f"n = 1.0\nif isinstance(cache, DynamicCache):\n    {rebinding}\n    {line}", _K, _V),
        layer=_LAYER + "self.block.register_forward_pre_hook(lambda m, args: (args[0], DynamicCache(), Sly(args[0])))",
        signature="x, cache=None, other=None",
        ret="return q * n + torch.cat([k, v], dim=-1)",
        extra=_F + "from transformers import DynamicCache\n",
    )


def _post(*lines: str, ret: str = "return q * w + torch.cat([k, v], dim=-1)", members: str = "") -> Toy:
    """`lines` after the last projection, reading `w` for the result."""
    return Toy((_Q, _K, _V, *lines), ret=ret, members=members, extra=_F)


def _escape(lines: tuple, hook: str, ret: str = "return q + torch.cat([k, v], dim=-1)", init: str = "") -> Toy:
    """A piece carried out of forward by `lines`; the block's forward hook `hook` (an expression of `m` and `out`)
    writes it in place afterwards."""
    return Toy(
        (_Q, _K, _V, *lines),
        ret=ret,
        init=init,
        layer=_LAYER + f"self.block.register_forward_hook(lambda m, args, out: [{hook}] and None)",
        extra=_F,
    )


_K_ROWS = "    @property\n    def k_rows(self):\n        return self.k_proj.out_features\n"

FOURTH_HAZARDS = {
    # 1. ambient state, switched by spellings with no state-switching call name in the region
    "ctx4_autocast_entered_through_bound_methods": Toy(
        (
            'ac = torch.autocast("cpu", dtype=torch.bfloat16)',
            "on, off = ac.__enter__, ac.__exit__",
            _Q,
            "on()",
            _K,
            "off(None, None, None)",
            _V,
        ),
        ret="return q + torch.cat([k.float(), v], dim=-1)",
        extra=_F,
    ),
    "ctx4_c_level_grad_switch": Toy(
        (
            "was = torch.is_grad_enabled()",
            _Q,
            "torch._C._set_grad_enabled(False)",
            _K,
            "torch._C._set_grad_enabled(was)",
            _V,
        ),
        extra=_F,
    ),
    "ctx4_partial_grad_switch": Toy(
        (
            "off = functools.partial(torch.set_grad_enabled, False)",
            "back = functools.partial(torch.set_grad_enabled, torch.is_grad_enabled())",
            _Q,
            "off()",
            _K,
            "back()",
            _V,
        ),
        extra=_F,
    ),
    "ctx4_no_grad_instance_reused": Toy(("quiet = torch.no_grad()", _Q, "with quiet:\n    " + _K, _V), extra=_F),
    "ctx4_lookalike_nullcontext": Toy((_Q, "with hushed():\n    " + _K, _V), extra=_F),
    "ctx4_decorator_on_nested_def": _flip_around_k("@flip_on_decoration\ndef marker():\n    return 0", before=()),
    "ctx4_decorator_on_nested_class": _flip_around_k("@flip_on_decoration\nclass Marker:\n    pass", before=()),
    "ctx4_class_body_switch": _flip_around_k("class Marker:\n    _flip()", before=()),
    "ctx4_generator_advanced_by_next": _flip_around_k("n = next(steps)", before=("steps = grad_off_then_back()",)),
    "ctx4_genexp_advanced_by_next": _flip_around_k("n = next(flips)", before=("flips = (_flip() for _ in range(2))",)),
    "ctx4_generator_drained_by_for": _flip_around_k(
        "for _ in zip(range(1), steps):\n    pass", before=("steps = grad_off_then_back()",)
    ),
    "ctx4_truth_test_dunder": Toy((_TOGGLE, _Q, "if sw:\n    pass", _K, "assert sw", _V), extra=_F),
    "ctx4_len_dunder": _flip_around_k("n = len(sw)"),
    "ctx4_fstring_dunder": _flip_around_k('tag = f"{sw}"'),
    "ctx4_compare_dunder": _flip_around_k("same = sw == 1"),
    "ctx4_property_of_object": _flip_around_k("s = sw.state"),
    "ctx4_match_subject": _flip_around_k("match sw:\n    case 1:\n        pass"),
    "ctx4_torch_state_function_renamed": Toy(
        (_Q, "handle = watch_linears(double_plain_linears)", _K, _V, "handle.remove()"), extra=_F
    ),
    "ctx4_torch_state_function_in_helper": Toy((_Q, "handle = watch_all()", _K, _V, "handle.remove()"), extra=_F),
    "ctx4_input_subclass_torch_function": Toy(
        (_Q, _K, _V),
        layer=_LAYER + "self.block.register_forward_pre_hook(lambda m, args: (args[0].as_subclass(EightRows),))",
        extra=_F,
    ),
    # 2. the caller's alias written by special methods, generators and positional `inplace`
    "alias4_len_dunder": _sly("n = len(cache)"),
    "alias4_truth_test_dunder": _sly("if cache:\n    pass"),
    "alias4_negated_truth_test_dunder": _sly("if not cache:\n    pass"),
    "alias4_set_member_hashed": _hashed("s = {cache}"),
    "alias4_dict_key_hashed": _hashed("s = {cache: 1.0}"),
    "alias4_set_comprehension_hashed": _hashed("s = {cache for _ in range(2)}"),
    "alias4_narrowed_then_rebound_truth": _rebound("if cache:\n        n = 2.0"),
    "alias4_narrowed_then_rebound_not": _rebound("if not cache:\n        n = 2.0"),
    "alias4_narrowed_then_rebound_len": _rebound("n = float(len(cache))"),
    "alias4_narrowed_then_rebound_method": _rebound("cache._bump()"),
    "alias4_narrowed_then_rebound_by_match": _rebound(
        "cache._bump()", "match (other,):\n        case (cache,):\n            n = 2.0"
    ),
    "alias4_narrowed_then_rebound_by_except": _rebound(
        "n = 2.0",
        "try:\n        raise ValueError(other)\n    except ValueError as cache:\n        cache.args[0]._bump()",
    ),
    "ctx4_comprehension_filter_dunder": _flip_around_k("ok = [1 for _ in range(1) if sw]"),
    "ctx4_negated_truth_test_dunder": Toy((_TOGGLE, _Q, "flag = not sw", _K, "assert not sw", _V), extra=_F),
    "alias4_binop_dunder": _sly("z = cache + 1.0"),
    "alias4_subscript_dunder": _sly("z = cache[0]"),
    "alias4_iteration_dunder": _sly("for item in cache:\n    pass"),
    "alias4_fstring_dunder": _sly('tag = f"{cache}"'),
    "alias4_membership_dunder": _sly("found = 1 in cache"),
    "alias4_property_of_object": _sly("z = cache.held"),
    "alias4_generator_advanced_by_next": Toy(
        ("steps = doubling_steps(y)", _Q, "next(steps)", _K, _V),
        layer=_LAYER + _pair("args[0]"),
        signature="x, y",
        extra=_F,
    ),
    "alias4_threshold_positional_inplace": Toy(
        (_Q, "F.threshold(y, 0.0, -1.0, True)", _K, _V), layer=_LAYER + _pair("args[0]"), signature="x, y", extra=_F
    ),
    "alias4_hardtanh_positional_inplace": Toy(
        (_Q, "F.hardtanh(y, -0.1, 0.1, True)", _K, _V), layer=_LAYER + _pair("args[0]"), signature="x, y", extra=_F
    ),
    "alias4_index_put_function": Toy(
        (_Q, "torch.index_put_(y, (torch.tensor([0]),), torch.tensor(0.0))", _K, _V),
        layer=_LAYER + _pair("args[0]"),
        signature="x, y",
        extra=_F,
    ),
    "alias4_copy_through_view_chain": Toy(
        (_Q, "y.view(-1)[:4].copy_(torch.zeros(4))", _K, _V),
        layer=_LAYER + _pair("args[0]"),
        signature="x, y",
        extra=_F,
    ),
    "alias4_walrus_receiver": Toy(
        (_Q, "(t := y).mul_(2.0)", _K, _V), layer=_LAYER + _pair("args[0]"), signature="x, y", extra=_F
    ),
    "alias4_set_storage": Toy(
        (_Q, "y.set_(torch.zeros_like(y))", _K, _V), layer=_LAYER + _pair("args[0]"), signature="x, y", extra=_F
    ),
    # 3. projections reached by name or through another object than `self`
    "ident4_super_getattr": _post('w = super().__getattr__("k_proj").weight.sum()'),
    "ident4_unbound_module_getattr": _post('w = nn.Module.__getattr__(self, "v_proj").weight.sum()'),
    "ident4_object_getattribute": _post('w = object.__getattribute__(self, "_modules")["k_proj"].weight.sum()'),
    "ident4_property_fget_on_type": _post("w = type(self).k_rows.fget(self)", members=_K_ROWS),
    "ident4_staticmethod_handed_self": _post("w = self.grab(self)", members="    grab = staticmethod(peek)\n"),
    "ident4_self_under_another_name": Toy(
        ("me = self", _Q, _K, _V, "w = me.k_proj.weight.sum()"),
        ret="return q * w + torch.cat([k, v], dim=-1)",
        extra=_F,
    ),
    "ident4_self_in_a_list": Toy(
        ("blocks = [self]", _Q, _K, _V, "w = blocks[0].v_proj.weight.sum()"),
        ret="return q * w + torch.cat([k, v], dim=-1)",
        extra=_F,
    ),
    "ident4_getattr_static": _post('w = inspect.getattr_static(self, "k_proj").weight.sum()'),
    "ident4_dict_by_getattr": _post('w = getattr(self, "__dict__")["_modules"]["k_proj"].weight.sum()'),
    "ident4_named_children_count": _post("w = float(sum(1 for _ in self.named_children()))"),
    "ident4_map_over_projections": Toy(
        ("q, k, v = map(lambda p: p(x), (self.q_proj, self.k_proj, self.v_proj))",), extra=_F
    ),
    "ident4_functional_call": Toy(
        (_Q, "k = torch.func.functional_call(self.k_proj, dict(self.k_proj.named_parameters()), (x,))", _V),
        extra=_F,
    ),
    # 4. pieces whose layout or identity shows, or that leave forward inside another object
    "piece4_transposed_stride": _post("w = float(k.mT.stride()[-1])"),
    "piece4_view_spelled_on_class": Toy(
        (_Q, "k = torch.Tensor.view(self.k_proj(x), -1)", _V),
        ret="return q + torch.cat([k.view(v.shape), v], dim=-1)",
        extra=_F,
    ),
    "piece4_view_as_flat": Toy(
        (_Q, _K, _V, "flat = k.view_as(torch.empty(k.numel()))"),
        ret="return q + torch.cat([flat.view(v.shape), v], dim=-1)",
        extra=_F,
    ),
    "piece4_as_strided": _post("k = k.as_strided(k.shape, (k.shape[1] * 8, 8, 1))", "w = 1.0"),
    "piece4_contiguous_identity": _post("w = 2.0 if k.contiguous() is k else 1.0"),
    "piece4_base_attribute": _post("w = 2.0 if k._base is None else 1.0"),
    "piece4_storage_through_class": _post("w = float(torch.Tensor.untyped_storage(k).nbytes())"),
    "piece4_in_dict_stored": _escape(('self.seen = {"k": k}',), 'm.seen["k"].mul_(2.0)'),
    "piece4_in_namedtuple_stored": _escape(("self.seen = KV(k, v)",), "m.seen.k.mul_(2.0)"),
    "piece4_in_dataclass_returned": Toy(
        (_Q, _K, _V),
        ret="return Out(total=q + torch.cat([k, v], dim=-1), k=k)",
        layer=_LAYER + "self.block.register_forward_hook(lambda m, args, out: (out.k.mul_(2.0), out.total)[1])",
        extra=_F,
    ),
    "piece4_captured_by_lambda": _escape(("self.later = lambda: k",), "m.later().mul_(2.0)"),
    "piece4_captured_by_nested_def": _escape(
        ("def later():\n    return v", "self.later = later"), "m.later().mul_(2.0)"
    ),
    "piece4_global_name": _escape(("global LAST_K", "LAST_K = k"), "LAST_K.mul_(2.0)"),
    "piece4_appended_to_global_list": _escape(("CACHE.append(k)",), "CACHE[-1].mul_(2.0)"),
    "piece4_setattr_builtin": _escape(('setattr(self, "seen", v)',), "m.seen.mul_(2.0)"),
    "piece4_operator_setitem_global": _escape(("operator.setitem(SLOTS, 0, k)",), "SLOTS[0].mul_(2.0)"),
    "piece4_appended_to_own_list": _escape(
        ("self.store.append(k)",), "m.store[-1].mul_(2.0)", init="        self.store = []\n"
    ),
    "piece4_copy_through_view_chain": _post("k.view(k.shape)[..., :2].copy_(torch.zeros(2))", "w = 1.0"),
    "piece4_index_put_function": _post("torch.index_put_(k, (torch.tensor([0]),), torch.tensor(1.0))", "w = 1.0"),
    "piece4_operator_setitem_write": _post("operator.setitem(v, (0, 0), 0.0)", "w = 1.0"),
    "piece4_unsqueeze_in_place": _post("k.unsqueeze_(0)", "k = k[0]", "w = 1.0"),
    "piece4_set_storage": _post("k.set_(k.clone())", "w = 1.0"),
    # 5. writes a function does not announce by name
    "write4_dropout_positional_inplace": Toy(
        (_Q, "F.dropout(y, 0.5, self.training, True)", _K, _V),
        layer=_LAYER + _pair("args[0]"),
        signature="x, y",
        extra=_F,
    ),
    # 6. found by the family fuzzer (issue 24, item 8): what a builtin returns, or calls, is user code; an identity
    # compared through `id`. Each fused and miscompiled before (regions_rules `_builtin_result_known`,
    # `_called_operand`; pieces `_identity_function`).
    "ctx4_lazy_map_of_a_flip": Toy(
        ("ticks = map(flip_on_decoration, (1, 2, 3))", _Q, "n = next(ticks)", _K, "n = next(ticks)", _V),
        ret="return q * n + torch.cat([k, v], dim=-1)",
        extra=_F,
    ),
    "ctx4_lazy_filter_of_a_flip": Toy(
        ("ticks = filter(flip_on_decoration, (1, 2, 3))", _Q, "n = next(ticks)", _K, "n = next(ticks)", _V),
        ret="return q * n + torch.cat([k, v], dim=-1)",
        extra=_F,
    ),
    "ctx4_iter_with_a_sentinel": Toy(("ticks = iter(_flip, 0)", _Q, "next(ticks)", _K, "next(ticks)", _V), extra=_F),
    "ctx4_zip_over_a_generator": Toy(
        ("ticks = zip(grad_off_then_back(), 'ab')", _Q, "next(ticks)", _K, "next(ticks)", _V), extra=_F
    ),
    "ctx4_key_function_of_max": _flip_around_k("top = max((3,), key=flip_on_decoration)", before=()),
    "ctx4_key_function_of_sorted": _flip_around_k("order = sorted([2], key=flip_on_decoration)", before=()),
    "ctx4_caller_object_picked_by_min": _flip_around_k("if sw:\n    pass", before=("sw = min([Toggle()])",)),
    "alias4_iter_with_a_sentinel_writing": Toy(
        ("steps = iter(functools.partial(y.mul_, 3.0), None)", _Q, "next(steps)", _K, _V),
        layer=_LAYER + _pair("args[0]"),
        signature="x, y",
        extra=_F,
    ),
    "piece4_identity_compared_by_id": _post("w = 2.0 if id(v) == id(v.contiguous()) else 1.0"),
    "alias4_operator_function_dunder": _sly("z = operator.add(cache, 1.0)"),
    "ctx4_operator_function_dunder": _flip_around_k("same = operator.eq(sw, 1)"),
    "piece4_kept_by_a_lambda_default": _escape(("self.later = lambda held=k: held",), "m.later().mul_(2.0)"),
    "piece4_kept_by_a_def_default": _escape(
        ("def later(held=v):\n    return held", "self.later = later"), "m.later().mul_(2.0)"
    ),
    "piece4_kept_by_a_generator": _escape(("self.later = (t for t in (k,))",), "next(m.later).mul_(2.0)"),
    "piece4_record_in_a_list_stored": _escape(("self.seen = [KV(k, v)]",), "m.seen[0].k.mul_(2.0)"),
    "piece4_walrus_stored": _escape(("self.seen = (kept := v)",), "m.seen.mul_(2.0)"),
}

FOURTH_SAFE = {
    "ctx4_nullcontext_with_a_value": Toy(
        (_Q, "with contextlib.nullcontext(2.0) as two:\n    " + _K, _V),
        ret="return q * two + torch.cat([k, v], dim=-1)",
        extra=_F,
    ),
    "ctx4_autocast_off_closed_between": Toy(
        (_Q, 'with torch.autocast("cpu", enabled=False):\n    n = x.sum()', _K, _V),
        ret="return q + torch.cat([k, v], dim=-1) + n",
        extra=_F,
    ),
    "ctx4_inference_mode_queried": Toy(
        (_Q, "inf = torch.is_inference_mode_enabled()", _K, _V),
        ret="return q * (2.0 if inf else 1.0) + torch.cat([k, v], dim=-1)",
        extra=_F,
    ),
    "alias4_len_of_tensor": Toy(
        (_Q, "n = len(y)", _K, _V),
        layer=_LAYER + _pair("args[0]"),
        signature="x, y: torch.Tensor",
        ret="return q * n + torch.cat([k, v], dim=-1)",
        extra=_F,
    ),
    "alias4_truth_of_shape": Toy(
        (_Q, "if x.shape[0]:\n    n = 2.0\nelse:\n    n = 1.0", _K, _V),
        ret="return q * n + torch.cat([k, v], dim=-1)",
        extra=_F,
    ),
    "alias4_fstring_of_shape": Toy(
        (_Q, 'tag = f"{x.shape[0]}"', _K, _V), ret="return q * len(tag) + torch.cat([k, v], dim=-1)", extra=_F
    ),
    "alias4_compare_of_width": Toy(
        (_Q, "wide = x.shape[-1] == 16", _K, _V),
        ret="return q * (2.0 if wide else 1.0) + torch.cat([k, v], dim=-1)",
        extra=_F,
    ),
    "alias4_threshold_out_of_place": Toy(
        (_Q, "z = F.threshold(y, 0.0, -1.0)", _K, _V),
        layer=_LAYER + _pair("args[0]"),
        signature="x, y: torch.Tensor",
        ret="return q + torch.cat([k, v], dim=-1) + z",
        extra=_F,
    ),
    "alias4_hardtanh_in_place_on_fresh": Toy(
        (_Q, "z = torch.zeros_like(x)", "F.hardtanh(z, -0.1, 0.1, True)", _K, _V),
        ret="return q + torch.cat([k, v], dim=-1) + z",
        extra=_F,
    ),
    "ident4_type_name_read": _post("w = 2.0 if type(self).__name__ else 1.0"),
    "piece4_transposed_product": _post("w = (k.mT @ k).sum()"),
    "piece4_clone_in_dict_stored": _escape(('self.seen = {"k": k.clone()}',), 'm.seen["k"].mul_(2.0)'),
    "piece4_pair_unpacked_locally": _post("pair = (k, v)", "k, v = pair", "w = 1.0"),
    "write4_dropout_positional_out_of_place": Toy(
        (_Q, "d = F.dropout(y, 0.0, self.training, False)", _K, _V),
        layer=_LAYER + _pair("args[0]"),
        signature="x, y: torch.Tensor",
        ret="return q + torch.cat([k, v], dim=-1) + d",
        extra=_F,
    ),
    "alias4_length_of_a_comprehension": Toy(
        (_Q, "n = float(len([1 for _ in range(2) if x.shape[0]]))", _K, _V),
        ret="return q * n + torch.cat([k, v], dim=-1)",
        extra=_F,
    ),
    "alias4_identity_test_of_a_caller_object": Toy(
        (_Q, "if cache is not None:\n    n = 2.0\nelse:\n    n = 1.0", _K, _V),
        layer=_LAYER + _pair("Sly(args[0])"),
        signature="x, cache=None",
        ret="return q * n + torch.cat([k, v], dim=-1)",
        extra=_F,
    ),
    "alias4_attribute_of_a_narrowed_transformers_cache": Toy(
        (
            _Q,
            "n = 1.0\nif isinstance(cache, DynamicCache):\n    layers = cache.layers\n    n = 2.0",
            _K,
            _V,
        ),
        signature="x, cache=None",
        ret="return q * n + torch.cat([k, v], dim=-1)",
        extra=_F + "from transformers import DynamicCache\n",
    ),
    "ident4_torch_helper_renamed_pure": Toy(
        ("join = torch.cat", _Q, _K, _V), ret="return q + join([k, v], dim=-1)", extra=_F
    ),
    "ctx4_lazy_map_of_a_builtin_over_a_shape": Toy(
        ("dims = map(abs, x.shape)", _Q, "n = next(dims)", _K, _V),
        ret="return q * n + torch.cat([k, v], dim=-1)",
        extra=_F,
    ),
    "ctx4_max_keyed_by_a_builtin": Toy(
        (_Q, "n = max(x.shape, key=abs)", _K, _V), ret="return q * n + torch.cat([k, v], dim=-1)", extra=_F
    ),
    "alias4_typed_parameter_cloned_then_written": Toy(
        (_Q, "t = y.clone()", "t.mul_(2.0)", _K, _V),
        layer=_LAYER + _pair("args[0]"),
        signature="x, y: torch.Tensor",
        ret="return q + torch.cat([k, v], dim=-1) + t",
        extra=_F,
    ),
    "ctx4_zip_over_a_shape": Toy(
        ("pairs = zip(x.shape, 'abc')", _Q, "n, tag = next(pairs)", _K, _V),
        ret="return q * n + torch.cat([k, v], dim=-1)",
        extra=_F,
    ),
}


# --- fifth batch: the same families, spelled through Python semantics the earlier batches leave alone --------------
#
# Judged as the third and fourth batches are (`fusegen.tools.oracle.verdict`). The module-level code (`_H5`, after the
# fourth batch's helpers) holds: profile and trace functions that count `nn.Linear.forward` calls, objects whose
# `__del__`, weakref finalizer, generator `finally` or exception `__init__` switch grad mode, a `__class__` property,
# a `__torch_function__` on a plain object and a mapping whose special methods write what they hold, a module-level
# `functools.partial` and `singledispatch` function that switch grad mode, a data descriptor and a class-level module
# that shadow a registered projection, and a context variable that carries a piece out of forward.

_H5 = '''
import contextvars
import weakref

from transformers import DynamicCache

SEEN = []
LAST_PIECE = contextvars.ContextVar("LAST_PIECE")
QUIET = functools.partial(torch._C._set_grad_enabled, False)
LOUD = functools.partial(torch._C._set_grad_enabled, True)


def count_linears(frame, event, arg):
    """A profile or trace function: counts the calls of `nn.Linear.forward`."""
    if event == "call" and frame.f_code is nn.Linear.forward.__code__:
        SEEN.append(1)
    return None


class FlipOnDel:
    """Flips grad mode (`_flip`) when it is collected."""

    def __del__(self):
        _flip()


class Anchor:
    """A plain object a weakref finalizer can watch."""


class FlipRaised(Exception):
    """Flips grad mode when it is made (a bare `raise FlipRaised` makes it)."""

    def __init__(self, *args):
        _flip()
        super().__init__(*args)


def flip_when_closed():
    """A generator whose `finally` flips grad mode when it is closed or collected."""
    try:
        yield 1
    finally:
        _flip()


@functools.singledispatch
def note(value):
    return 0


@note.register
def _(value: float):
    _flip()
    return 1


class WriteOnDel:
    """Holds a tensor; doubles it in place when it is collected."""

    def __init__(self, t):
        self.t = t

    def __del__(self):
        self.t.mul_(2.0)


class Masked:
    """Holds a tensor; reading its `__class__` (as `isinstance` does) doubles the tensor in place."""

    def __init__(self, t):
        self.t = t

    @property
    def __class__(self):
        self.t.mul_(2.0)
        return Masked


class Liar:
    """Holds a tensor; says its class is `DynamicCache` (`__class__`), and reading `layers` doubles the tensor."""

    def __init__(self, t):
        self.t = t

    @property
    def __class__(self):
        return DynamicCache

    @property
    def layers(self):
        self.t.mul_(2.0)
        return []


class Hijack:
    """Holds a tensor; any torch function handed it doubles the tensor in place (`__torch_function__`)."""

    def __init__(self, t):
        self.t = t

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        for a in args:
            if isinstance(a, Hijack):
                a.t.mul_(2.0)
        return torch.tensor(1.0)


class Mappy:
    """Holds a tensor; listing its keys (`{**m}`, `dict(m)`) doubles the tensor in place."""

    def __init__(self, t):
        self.t = t

    def keys(self):
        self.t.mul_(2.0)
        return []

    def __getitem__(self, key):
        return 0


class Doubler(torch.autograd.Function):
    """Doubles its argument in place (marked dirty)."""

    @staticmethod
    def forward(ctx, t):
        ctx.mark_dirty(t)
        return t.mul_(2.0)

    @staticmethod
    def backward(ctx, grad):
        return grad * 2.0


class DoubledProjection:
    """A data descriptor on the block's class: `self.k_proj` reads the registered linear, doubled."""

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        linear = obj._modules["k_proj"]
        return lambda t: linear(t) * 2.0

    def __set__(self, obj, value):
        obj._modules["k_proj"] = value
'''

_H5_ALL = _F + _H5


def _t5(*body: str, ret: str = "return q + torch.cat([k, v], dim=-1)", **kw) -> Toy:
    return Toy(body, ret=ret, extra=_H5_ALL, **kw)


def _alias5(line: str, holder: str = "args[0]", ret: str = "return q + torch.cat([k, v], dim=-1)") -> Toy:
    """`cache` is the caller's `holder` of the input; `line` runs between q and k."""
    return Toy((_Q, line, _K, _V), layer=_LAYER + _pair(holder), signature="x, cache=None", ret=ret, extra=_H5_ALL)


def _escape5(*lines: str, hook: str = "m.seen.mul_(2.0)", signature: str = "x") -> Toy:
    """A piece carried out of forward by `lines` (after v); the block's forward hook `hook` writes it afterwards."""
    return Toy(
        (_Q, _K, _V, *lines),
        layer=_LAYER + f"self.block.register_forward_hook(lambda m, args, out: [{hook}] and None)",
        signature=signature,
        extra=_H5_ALL,
    )


_COUNTED = "return q * float(len(SEEN)) + torch.cat([k, v], dim=-1)"

FIFTH_HAZARDS = {
    # 1. ambient state switched with no call in the region, or by a call the rules do not name
    "ctx5_setprofile_counts_linears": _t5(
        "SEEN.clear()", "sys.setprofile(count_linears)", _Q, _K, _V, "sys.setprofile(None)", ret=_COUNTED
    ),
    "ctx5_settrace_counts_linears": _t5(
        "SEEN.clear()",
        "was = sys.gettrace()",
        "sys.settrace(count_linears)",
        _Q,
        _K,
        _V,
        "sys.settrace(was)",
        ret=_COUNTED,
    ),
    "ctx5_del_by_rebinding": _t5("a, b = FlipOnDel(), FlipOnDel()", _Q, "a = None", _K, "b = None", _V),
    "ctx5_del_statement": _t5("a = FlipOnDel()", "b = FlipOnDel()", _Q, "del a", _K, "del b", _V),
    "ctx5_weakref_finalize": _t5(
        "a, b = Anchor(), Anchor()",
        "weakref.finalize(a, _flip)",
        "weakref.finalize(b, _flip)",
        _Q,
        "a = 0",
        _K,
        "b = 0",
        _V,
    ),
    "ctx5_generator_finally": _t5(
        "g, h = flip_when_closed(), flip_when_closed()", "next(g)", "next(h)", _Q, "g = None", _K, "h = None", _V
    ),
    "ctx5_raise_makes_exception": _t5(
        _Q,
        "try:\n    raise FlipRaised\nexcept FlipRaised:\n    pass",
        _K,
        "try:\n    raise FlipRaised\nexcept FlipRaised:\n    pass",
        _V,
    ),
    "ctx5_inference_mode_guard_object": _t5(_Q, "guard = torch._C._InferenceMode(True)", _K, "del guard", _V),
    "ctx5_module_level_partial": _t5(
        "was = torch.is_grad_enabled()", _Q, "QUIET()", _K, "LOUD() if was else None", _V
    ),
    "ctx5_singledispatch": _t5(_Q, "note(1.0)", _K, "note(2.0)", _V),
    "ctx5_chained_comparison": _t5(_TOGGLE, _Q, "ok = 2 == x.shape[0] == sw", _K, "ok = 2 == x.shape[0] == sw", _V),
    "ctx5_global_hook_table_item_store": _t5(
        _Q,
        "torch.nn.modules.module._global_forward_hooks[-5] = double_plain_linears",
        _K,
        _V,
        "del torch.nn.modules.module._global_forward_hooks[-5]",
    ),
    "ctx5_nested_def_flips": _t5("def quiet():\n    _flip()", _Q, "quiet()", _K, "quiet()", _V),
    "ctx5_grad_switch_in_conditional_expression": _t5(
        "keep = torch.is_grad_enabled()",
        _Q,
        "torch._C._set_grad_enabled(False) if keep else None",
        _K,
        "torch._C._set_grad_enabled(keep)",
        _V,
    ),
    # 2. the caller's alias written through implicit special methods, torch dispatch, and calls the rules trust
    "alias5_del_of_holder": Toy(
        ("holder = WriteOnDel(cache)", _Q, "holder = None", _K, _V),
        layer=_LAYER + _pair("args[0]"),
        signature="x, cache=None",
        extra=_H5_ALL,
    ),
    "alias5_isinstance_class_property": _alias5(
        "n = 2.0 if isinstance(cache, torch.Tensor) else 1.0",
        "Masked(args[0])",
        ret="return q * n + torch.cat([k, v], dim=-1)",
    ),
    "alias5_class_property_lies_to_narrowing": _alias5(
        "n = 1.0\nif isinstance(cache, DynamicCache):\n    layers = cache.layers\n    n = 2.0",
        "Liar(args[0])",
        ret="return q * n + torch.cat([k, v], dim=-1)",
    ),
    "alias5_torch_function_on_object": _alias5(
        "z = torch.sum(cache)", "Hijack(args[0])", ret="return q * z + torch.cat([k, v], dim=-1)"
    ),
    "alias5_star_in_list": _alias5("items = [*cache]", "Sly(args[0])"),
    "alias5_star_in_call": _alias5("n = max(0, 1, *cache)", "Sly(args[0])"),
    "alias5_starred_target": _alias5("*items, = cache", "Sly(args[0])"),
    "alias5_dict_unpacking": _alias5("d = {**cache}", "Mappy(args[0])"),
    "alias5_str_format_method": _alias5('tag = "{}".format(cache)', "Sly(args[0])"),
    "alias5_str_join_iterates": _alias5('tag = "-".join(cache)', "Sly(args[0])"),
    "alias5_any_iterates": _alias5("n = any(cache)", "Sly(args[0])"),
    "alias5_sorted_iterates": _alias5("s = sorted(cache)", "Sly(args[0])"),
    "alias5_torch_tensor_of_sequence": _alias5(
        "z = torch.tensor(cache)", "Sly(args[0])", ret="return q + torch.cat([k, v], dim=-1) + z.sum()"
    ),
    "alias5_vector_to_parameters": _alias5("torch.nn.utils.vector_to_parameters(torch.zeros(cache.numel()), [cache])"),
    "alias5_aten_overload_in_place": _alias5("torch.ops.aten.mul_.Tensor(cache, torch.tensor(2.0))"),
    "alias5_leaky_relu_positional_inplace": _alias5("F.leaky_relu(cache, 3.0, True)"),
    "alias5_rrelu_positional_inplace": _alias5("F.rrelu(cache, 2.0, 4.0, False, True)"),
    "alias5_autograd_function_dirty": _alias5("cache = Doubler.apply(cache)"),
    "alias5_data_setter": _alias5("cache.data = cache.data * 2.0"),
    # 3. a projection that `self.<proj>` does not reach, or a call that watches the projections
    "ident5_method_shadows_module": _t5(
        _Q, _K, _V, members="    def v_proj(self, t):\n        return t[..., :8] * 2.0\n"
    ),
    "ident5_getattribute_swaps_projection": _t5(
        _Q,
        _K,
        _V,
        members=(
            "    def __getattribute__(self, name):\n"
            '        return super().__getattribute__("v_proj" if name == "k_proj" else name)\n'
        ),
    ),
    "ident5_getattr_swaps_projection": _t5(
        _Q,
        _K,
        _V,
        members=(
            "    def __getattr__(self, name):\n"
            '        return super().__getattr__("v_proj" if name == "k_proj" else name)\n'
        ),
    ),
    "ident5_data_descriptor_on_class": _t5(_Q, _K, _V, members="    k_proj = DoubledProjection()\n"),
    "ident5_getattr_override": _t5(
        _Q,
        _K,
        _V,
        members=(
            "    def __getattr__(self, name):\n"
            "        found = super().__getattr__(name)\n"
            '        return (lambda t: found(t) * 2.0) if name == "v_proj" else found\n'
        ),
    ),
    "ident5_getattribute_override": _t5(
        _Q,
        _K,
        _V,
        members=(
            "    def __getattribute__(self, name):\n"
            "        found = super().__getattribute__(name)\n"
            '        return (lambda t: found(t) * 2.0) if name == "k_proj" else found\n'
        ),
    ),
    # 4. pieces whose storage shows, written in place, or carried out by spellings the earlier batches do not use
    "piece5_storage_offset": _t5(
        _Q, _K, _V, "w = float(k.storage_offset()) + 1.0", ret="return q * w + torch.cat([k, v], dim=-1)"
    ),
    "piece5_is_view": _t5(
        _Q, _K, _V, "w = 2.0 if k._is_view() else 1.0", ret="return q * w + torch.cat([k, v], dim=-1)"
    ),
    "piece5_detach_in_place": _t5(_Q, _K, _V, "k.detach_()"),
    "piece5_escape_for_target": _escape5("for self.seen in (k,):\n    pass"),
    "piece5_escape_with_target": _escape5("with contextlib.nullcontext(k) as self.seen:\n    pass"),
    "piece5_escape_tuple_target": _escape5("self.seen, self.other = k, v"),
    "piece5_escape_instance_dict": _escape5('self.__dict__["seen"] = k'),
    "piece5_escape_vars": _escape5('vars(self)["seen"] = v'),
    "piece5_escape_object_setattr": _escape5('object.__setattr__(self, "seen", k)'),
    "piece5_escape_context_variable": _escape5("LAST_PIECE.set(k)", hook="LAST_PIECE.get().mul_(2.0)"),
    "piece5_escape_exception_args": _escape5(
        "try:\n    raise ValueError(k)\nexcept ValueError as e:\n    self.err = e", hook="m.err.args[0].mul_(2.0)"
    ),
    "piece5_escape_lambda_default": _escape5("self.later = lambda t=v: t", hook="m.later().mul_(2.0)"),
    "piece5_escape_partial": _escape5("self.later = functools.partial(lambda t: t, k)", hook="m.later().mul_(2.0)"),
    "piece5_escape_annotated_attribute": _escape5("self.seen: torch.Tensor = k"),
    "piece5_escape_augmented_list": _escape5("self.kept = []", "self.kept += [v]", hook="m.kept[-1].mul_(2.0)"),
    "piece5_escape_setattr_on_held_object": Toy(
        (_Q, _K, _V, 'setattr(self.box, "seen", k)'),
        init="        self.box = types.SimpleNamespace()\n",
        layer=_LAYER + "self.block.register_forward_hook(lambda m, args, out: [m.box.seen.mul_(2.0)] and None)",
        extra=_H5_ALL + "import types\n",
    ),
    "piece5_escape_unbound_list_append": Toy(
        (_Q, _K, _V, "list.append(self.store, v)"),
        init="        self.store = []\n",
        layer=_LAYER + "self.block.register_forward_hook(lambda m, args, out: [m.store[-1].mul_(2.0)] and None)",
        extra=_H5_ALL,
    ),
    "piece5_escape_iterator_attribute": _escape5("self.it = iter((k,))", hook="next(m.it).mul_(2.0)"),
    "piece5_escape_max_of_pieces": _escape5("self.seen = max([k], key=id)"),
    "piece5_escape_through_identity_module": Toy(
        (_Q, _K, _V, "self.seen = self.same(k)"),
        init="        self.same = nn.Identity()\n",
        layer=_LAYER + "self.block.register_forward_hook(lambda m, args, out: [m.seen.mul_(2.0)] and None)",
        extra=_H5_ALL,
    ),
    "piece5_escape_through_eval_dropout": _escape5("self.seen = F.dropout(k, 0.5, False)"),
    "piece5_escape_to_caller_list": Toy(
        (_Q, _K, _V, "sink.append(k)"),
        layer=_LAYER
        + _pair("CACHE")
        + "\n"
        + _LAYER
        + "self.block.register_forward_hook(lambda m, args, out: [CACHE[-1].mul_(2.0)] and None)",
        signature="x, sink=None",
        extra=_H5_ALL,
    ),
}

FIFTH_SAFE = {
    "ctx5_rebinding_a_tensor_to_none": _t5("tmp = x.sum()", _Q, "tmp = None", _K, _V),
    "ctx5_del_of_a_tensor": _t5("tmp = x * 2.0", _Q, "del tmp", _K, _V),
    "ctx5_try_finally_pure": _t5(
        _Q,
        "try:\n    n = x.shape[0]\nfinally:\n    m = 1.0",
        _K,
        _V,
        ret="return q * (n * m) + torch.cat([k, v], dim=-1)",
    ),
    "ctx5_chained_comparison_of_ints": _t5(
        _Q, "ok = 0 < x.shape[0] < 100", _K, _V, ret="return q * (2.0 if ok else 1.0) + torch.cat([k, v], dim=-1)"
    ),
    "alias5_star_of_shape": _t5(
        _Q, "dims = [*x.shape]", _K, _V, ret="return q * len(dims) + torch.cat([k, v], dim=-1)"
    ),
    "alias5_isinstance_of_input": _t5(
        _Q, "n = 2.0 if isinstance(x, torch.Tensor) else 1.0", _K, _V, ret="return q * n + torch.cat([k, v], dim=-1)"
    ),
    "alias5_leaky_relu_out_of_place": Toy(
        (_Q, "z = F.leaky_relu(y, 3.0, False)", _K, _V),
        layer=_LAYER + _pair("args[0]"),
        signature="x, y: torch.Tensor",
        ret="return q + torch.cat([k, v], dim=-1) + z",
        extra=_H5_ALL,
    ),
    "alias5_inplace_on_new_empty": _t5(
        _Q,
        "z = x.new_empty(x.shape)",
        "z.copy_(x)",
        "z.mul_(2.0)",
        _K,
        _V,
        ret="return q + torch.cat([k, v], dim=-1) + z",
    ),
    "alias5_augassign_on_zeros_like": _t5(
        _Q, "acc = torch.zeros_like(x)", "acc += x", _K, _V, ret="return q + torch.cat([k, v], dim=-1) + acc"
    ),
    "piece5_storage_offset_of_input": _t5(
        _Q, _K, _V, "w = float(x.storage_offset()) + 1.0", ret="return q * w + torch.cat([k, v], dim=-1)"
    ),
    "piece5_detach_out_of_place": _t5(_Q, _K, _V, "k = k.detach()"),
    "piece5_clone_escapes_for_target": _escape5("for self.seen in (k.clone(),):\n    pass"),
    "ident5_class_attribute_plain_number": _t5(
        _Q, _K, _V, "w = self.scale", members="    scale = 2.0\n", ret="return q * w + torch.cat([k, v], dim=-1)"
    ),
}


HAZARD_BATCHES = {"third": NEW_HAZARDS, "fourth": FOURTH_HAZARDS, "fifth": FIFTH_HAZARDS}
SAFE_BATCHES = {"third": NEW_SAFE, "fourth": FOURTH_SAFE, "fifth": FIFTH_SAFE}


def _batch_cases(batches: dict, slow: tuple[str, ...] = ()) -> list:
    """One parameter per case of every batch, id `<batch>_batch-<name>` (`-k fourth_batch` picks a batch); the
    batches named in `slow` are marked slow."""
    return [
        pytest.param(cases[name], name, id=f"{batch}_batch-{name}", marks=[pytest.mark.slow] * (batch in slow))
        for batch, cases in batches.items()
        for name in sorted(cases)
    ]


# the fourth and fifth batches, each case built and, when fused, run under 8 modes: minutes, past the fast suite's bar
@pytest.mark.parametrize(("toy", "name"), _batch_cases(HAZARD_BATCHES, slow=("fourth", "fifth")))
def test_batch_hazard_is_refused_or_sound(case_path, toy, name):
    verdict = _verdict(case_path, write_toy(case_path, name, toy), name, validate=False)
    assert verdict in ("refused", "sound"), verdict


@pytest.mark.slow  # each case validated by the build, then run under 8 modes
@pytest.mark.parametrize(("toy", "name"), _batch_cases(HAZARD_BATCHES))
def test_batch_hazard_is_refused_or_sound_with_validation(case_path, toy, name):
    verdict = _verdict(case_path, write_toy(case_path, name, toy), name, validate=True)
    assert verdict in ("refused", "sound"), verdict


@pytest.mark.parametrize(("toy", "name"), _batch_cases(SAFE_BATCHES))
def test_batch_safe_twin_is_fused_and_sound(case_path, toy, name):
    verdict = _verdict(case_path, write_toy(case_path, name, toy), name, validate=False)
    assert verdict == "sound", verdict
