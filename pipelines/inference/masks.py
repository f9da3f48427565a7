"""The masks of a job's run folder, as every process of the inference job sees them: the
folders they go in (:class:`MaskFolders`) and the rules they are finished by (:class:`Rules`).

Nothing here imports more than the contract: the job's main process holds these before it forks
its workers, and imports neither the finish stage's code (Pillow, libpng, scipy, scikit-image),
which only the workers run (:mod:`pipelines.inference.finish`), nor torch, which only it needs
(:mod:`pipelines.infer`).
"""

from __future__ import annotations

import stat
from dataclasses import dataclass

from daemon.contract.heldfolder import HeldFolder, parts_of
from pipelines.layout import MASKS_DIR, label_image_name, mask_name


@dataclass(frozen=True)
class Rules:
    """What the finish stage needs of the job's parameters (objects are made by
    :func:`pipelines.inference.finish.object_ids`)."""

    min_area: int
    split_neck: float  # touching objects cut apart (pipelines.instances); 0: never
    fsync_each: bool  # the masks' filesystem needs an fsync per file (durable.each_file)


class MaskFolders:
    """The folders of masks under ``masks/`` of the held run folder, each held once (made when
    first needed) and kept for the process's life: a mask write opens only its own file."""

    def __init__(self, run: HeldFolder) -> None:
        self.run = run
        self.held: dict[str, HeldFolder] = {}

    def of(self, input_path: str) -> tuple[HeldFolder, str]:
        """The held folder of the mask of ``input_path``, and the input's name (its mask's
        is :func:`mask_name` of it, its label image's :func:`label_image_name`)."""
        *above, name = parts_of(input_path)
        folder = "/".join((MASKS_DIR, *above))
        if folder not in self.held:
            self.held[folder] = self.run.folder(folder, create=True)
        return self.held[folder], name

    def present(self, input_path: str, tiled: bool) -> bool:
        """Whether the mask of ``input_path`` is there (nothing is made): a plain file, or the
        label image's folder for an image segmented window by window."""
        try:
            if tiled:
                label_image = f"{MASKS_DIR}/{label_image_name(input_path)}"
                return stat.S_ISDIR(self.run.lstat(label_image).st_mode)
            return stat.S_ISREG(self.run.lstat(f"{MASKS_DIR}/{mask_name(input_path)}").st_mode)
        except (OSError, ValueError):  # missing, or a planted entry on the way
            return False

    def close(self) -> None:
        for folder in self.held.values():
            folder.close()
        self.held.clear()
