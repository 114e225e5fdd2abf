"""``tessera generate``: stream a completion from a model, then report prefill and decode tokens/s."""

from __future__ import annotations

import argparse
import sys

from tessera.tools.placement_flags import add_placement_flags
from tessera.tools.weight_flags import add_weight_flags, keep_quantized

DEFAULT_PROMPT = "Write one sentence about the sea."


def add_parser(commands) -> None:
    p = commands.add_parser("generate", help="stream a completion (default model: SmolLM2-135M-Instruct GGUF)")
    p.add_argument("prompt", nargs="?", default=DEFAULT_PROMPT)
    p.add_argument("--model", help="GGUF file or Hugging Face directory")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    add_placement_flags(p)
    add_weight_flags(p)
    p.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    from tessera.engine import LLM, SamplingParams
    from tessera.engine.chat import render_chat

    llm = LLM(args.model, dtype=args.dtype, backend=args.backend, max_num_seqs=1, keep_quantized=keep_quantized(args),
              device=args.device)
    prompt = args.prompt
    if args.chat:
        if llm.model.chat_template is None:
            print("error: --chat needs a model with a chat template", file=sys.stderr)
            return 2
        prompt = render_chat(llm.model.chat_template, [{"role": "user", "content": args.prompt}])
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            seed=args.seed)
    for delta in llm.stream(prompt, params):
        print(delta, end="", flush=True)
    out = llm.last_output
    print()
    if out is not None and out.time_to_first_token and out.latency:
        prefill = len(out.prompt_tokens) / out.time_to_first_token
        decode_time = out.latency - out.time_to_first_token
        decode = (len(out.token_ids) - 1) / decode_time if len(out.token_ids) > 1 and decode_time > 0 else 0.0
        print(f"[{len(out.prompt_tokens)} prompt tokens, prefill {prefill:.0f} tok/s; {len(out.token_ids)} new tokens, "
              f"decode {decode:.1f} tok/s; finish: {out.finish_reason}]", file=sys.stderr)
    return 0
