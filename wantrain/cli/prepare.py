"""``wantrain prepare SOURCE [OUT]``: long videos (and images) -> a training folder of clips on the frame buckets.

Scene cuts, clips on the buckets at the training rate, a manifest per clip, resumable (docs/data.md, From raw
footage). Prints one line per unreadable file and a summary; exit 0 when done, 2 for bad input, 130 on Ctrl-C
(every finished clip kept).
"""

from __future__ import annotations

import argparse
from pathlib import Path


def _frames(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.replace(" ", "").split(",") if x)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give frame counts separated by commas, e.g. 33,81") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", type=Path, help="folder of videos and images (searched recursively), or one video")
    parser.add_argument("out", type=Path, nargs="?", default=None,
                        help="folder for the clips (default: the config's data.path)")
    parser.add_argument("--config", type=Path, default=None,
                        help="run config whose data.frames and data.fps the clips land on (and data.path)")
    parser.add_argument("--set", dest="set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override a config key (value read as TOML; repeatable)")
    parser.add_argument("--frames", type=_frames, default=None,
                        help="frame buckets, e.g. 33,81 (default: the config's; each 4k+1)")
    parser.add_argument("--fps", type=float, default=None,
                        help="rate the clips are written at (default: the config's, else 16)")
    parser.add_argument("--stride", type=int, default=None,
                        help="frames between window starts in a long scene (default: the clip length, no overlap)")
    parser.add_argument("--threshold", type=float, default=27.0,
                        help="content detector threshold (PySceneDetect's; lower finds more cuts; default 27)")
    parser.add_argument("--min-scene-len", type=int, default=15,
                        help="cuts closer than this many frames are merged (flashes; default 15)")
    parser.add_argument("--max-side", type=int, default=None,
                        help="shrink clips so their longer side is at most this (default: the source size)")
    parser.add_argument("--crf", type=int, default=18, help="H.264 constant quality (lower is better; default 18)")
    parser.add_argument("--preset", default="veryfast", help="x264 preset (default veryfast)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    from wantrain.app.prepare import PrepareRequest, prepare

    summary = prepare(PrepareRequest(
        source=args.source, out=args.out, config=args.config, overrides=tuple(args.set), frames=args.frames,
        fps=args.fps, stride=args.stride, threshold=args.threshold, min_scene_len=args.min_scene_len,
        max_side=args.max_side, crf=args.crf, preset=args.preset), progress=not args.quiet)
    print(summary.format())
    return 0
