"""Small configs and IR builders shared by the tessera-dialect tests."""

from __future__ import annotations

from collections.abc import Sequence

from xdsl.builder import Builder, InsertPoint
from xdsl.dialects import func
from xdsl.dialects.builtin import ModuleOp

from tessera.mlir import dialect as td
from tessera.models.config import ModelConfig


def tiny_config(**overrides: object) -> ModelConfig:
    """A llama-style config small enough to read its IR: hidden 32, 4 q / 2 kv heads of 8, 2 layers."""
    fields = dict(family="llama", vocab_size=50, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8, max_position=128, norm_eps=1e-5, tie_embeddings=True,
                  rope_configs={"default": {"rope_theta": 10000.0, "rope_parameters": {"rope_type": "default"}}})
    fields.update(overrides)
    return ModelConfig(**fields)  # type: ignore[arg-type]


def module_of(arg_types: Sequence, build) -> ModuleOp:
    """``func.func @f(args) -> (result)`` whose body ``build(builder, args)`` writes; it returns the result value.
    Not verified: tests of verifiers call ``verify`` themselves."""
    fn = func.FuncOp("f", (list(arg_types), []))
    b = Builder(InsertPoint.at_end(fn.body.block))
    result = build(b, fn.body.block.args)
    b.insert(func.ReturnOp(result))
    fn.function_type = func.FunctionType.from_lists(list(arg_types), [result.type])
    return ModuleOp([fn])


def op_names(module: ModuleOp) -> list[str]:
    """The names of the ops in the module's function body, in order (the return included)."""
    fn = next(iter(module.body.block.ops))
    return [op.name for op in fn.body.block.ops]


def build(cls, operands, results, **attrs):
    return td.make(cls, operands, results, **attrs)
