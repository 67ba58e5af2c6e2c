"""``wantrain caption FOLDER --model MODEL_FOLDER``: a caption file for each clip, from a local vision-language
model (docs/data.md, From raw footage). Exit 0 when done, 2 for bad input (a missing or incompatible model folder
included), 130 on Ctrl-C (every caption written is kept)."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from wantrain.app.caption import DEFAULT_TEMPLATE

    parser.add_argument("folder", type=Path, nargs="?", default=None,
                        help="folder of clips (default: the config's data.path)")
    parser.add_argument("--model", type=Path, required=True,
                        help="folder of a downloaded image-text-to-text model (e.g. Qwen2.5-VL-7B-Instruct); "
                             "nothing is downloaded")
    parser.add_argument("--config", type=Path, default=None, help="run config: its data.path and caption_extension")
    parser.add_argument("--set", dest="set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override a config key (value read as TOML; repeatable)")
    parser.add_argument("--trigger", default="", help="trigger word every caption carries (e.g. ohwx)")
    parser.add_argument("--style", default="", help="a sentence added to the prompt (e.g. 'Be concise.')")
    parser.add_argument("--template", default=DEFAULT_TEMPLATE,
                        help="the prompt, with {frames}, {trigger}, {trigger_hint} and {style} (default: %(default)r)")
    parser.add_argument("--frames", type=int, default=4, help="frames shown per clip (default 4)")
    parser.add_argument("--batch-size", type=int, default=4, help="clips per generate call (default 4)")
    parser.add_argument("--max-new-tokens", type=int, default=160, help="longest answer in tokens (default 160)")
    parser.add_argument("--dtype", default="auto", help="auto (bf16 on a GPU, fp32 on the CPU), bf16, fp16, fp32")
    parser.add_argument("--quantize", default="none", help="none, 4bit or 8bit (bitsandbytes; CUDA)")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--max-side", type=int, default=448, help="frames shrunk to this longer side (default 448)")
    parser.add_argument("--overwrite", action="store_true", help="caption clips that already have a caption too")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    from wantrain.app.caption import CaptionerSettings, caption

    settings = CaptionerSettings(
        model=args.model, trigger=args.trigger, style=args.style, template=args.template, frames=args.frames,
        batch_size=args.batch_size, max_new_tokens=args.max_new_tokens, dtype=args.dtype, quantize=args.quantize,
        device=args.device, max_side=args.max_side, overwrite=args.overwrite)
    summary = caption(args.folder, settings, config=args.config, overrides=tuple(args.set), progress=not args.quiet)
    print(summary.format())
    return 0
