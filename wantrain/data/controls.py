"""Control files beside a clip: a control video, a mask video and a reference image, by name.

For a medium ``clips/dance.mp4`` (the stem ``dance``)::

    clips/dance.control.mp4   the video VACE follows (pose, depth, edges, ...: made by any tool), frame for frame
    clips/dance.mask.mp4      where to generate (white, > 50 %) and where to keep the clip (black), frame for frame
    clips/dance.ref.png       a reference image (the subject), one

Any video extension wantrain reads for ``control`` / ``mask`` and any image extension for ``ref``. A control or mask
video must have the clip's frame count (it is read at the clip's frames, retimed and cropped like it); one that
does not is skipped with the clip, one line each in ``wantrain check``. Only the VACE variants read these files;
other variants list them as ignored. A control file without its clip is listed as ignored too.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from wantrain.data.media import IMAGE_EXTENSIONS, VIDEO_EXTENSIONS, MediaError, decode_video, load_image

ROLES = {"control": VIDEO_EXTENSIONS, "mask": VIDEO_EXTENSIONS, "ref": IMAGE_EXTENSIONS}
"""Role (the name's second suffix) -> the extensions it may have."""


def role_of(path: Path) -> str | None:
    """``control`` / ``mask`` / ``ref`` for a control file's name (``dance.control.mp4``), else None."""
    stem = Path(path.stem)
    role = stem.suffix[1:].lower()
    if role in ROLES and path.suffix.lower() in ROLES[role] and stem.stem:
        return role
    return None


def split_media(media: list[Path]) -> tuple[list[Path], dict[Path, dict[str, Path]], list[dict[str, str]]]:
    """(the media that are clips, each clip's control files by role, control files of no clip with a reason)."""
    clips = [p for p in media if role_of(p) is None]
    by_stem = {(p.parent, p.stem): p for p in clips}
    controls: dict[Path, dict[str, Path]] = {}
    orphans = []
    for path in media:
        role = role_of(path)
        if role is None:
            continue
        owner = by_stem.get((path.parent, Path(path.stem).stem))
        if owner is None:
            orphans.append({"path": str(path), "reason": f"a {role} file of no clip (no medium named "
                                                         f"{Path(path.stem).stem}.* beside it)"})
        elif role in controls.setdefault(owner, {}):
            orphans.append({"path": str(path), "reason": f"a second {role} file of {owner.name} (one per clip; "
                                                         f"{controls[owner][role].name} is used)"})
        else:
            controls[owner][role] = path
    return clips, controls, orphans


def load_conditions(controls: dict[str, Path], indices: list[int], width: int, height: int,
                    rotation: int = 0) -> dict[str, torch.Tensor]:
    """The control files of one clip as the encoders take them: ``control`` float32 [3, F, H, W] in [-1, 1],
    ``mask`` [1, F, H, W] in {0, 1} (the frame's mean over its channels above half), ``reference`` [3, 1, H, W] in
    [-1, 1]; read at the clip's source frames ``indices`` and bucket size, covered and centre-cropped like the
    clip. Raises ``MediaError`` when a file cannot be read whole."""
    out: dict[str, torch.Tensor] = {}
    for role, path in sorted(controls.items()):
        if role == "ref":
            arr = load_image(path, width, height)
        else:
            decoded = decode_video(path, indices, width, height, rotation)
            if not decoded.complete:
                raise MediaError(f"cannot decode the {role} video '{path}' at the clip's frames "
                                 f"({decoded.error or f'{decoded.available} frames'})")
            arr = decoded.frames
        px = torch.from_numpy(np.require(arr, requirements=["C", "W"])).permute(3, 0, 1, 2).float()
        if role == "mask":
            out["mask"] = (px.mean(dim=0, keepdim=True) > 127.5).float()
        else:
            out["reference" if role == "ref" else role] = px.div_(127.5).sub_(1.0)
    return out
