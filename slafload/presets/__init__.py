"""Presets: feed a published model (Geneformer V1/V2, scGPT) the tokens it was trained on.

A :class:`Preset` is what a :class:`~slafload.loader.Loader` needs to reproduce a model's own
tokenizer, built from the model's dictionary files and the dataset's gene names: a
``tokenizer`` plus the chunk ``transforms`` that run before ranking, and a :class:`Coverage`
report of how much of the dataset the model's vocabulary sees::

    preset = geneformer_v2(ds, token_dictionary="token_dictionary_gc104M.pkl",
                           gene_median_dictionary="gene_median_dictionary_gc104M.pkl",
                           ensembl_mapping="ensembl_mapping_dict_gc104M.pkl")
    Loader(ds, tokenizer=preset)                     # or, by name:
    Loader(ds, tokenizer="geneformer-v2", tokenizer_options={"token_dictionary": ...})

Builders: :func:`~slafload.presets.geneformer.geneformer_v2`,
:func:`~slafload.presets.geneformer.geneformer_v1`, :func:`~slafload.presets.scgpt.scgpt`
(names ``"geneformer-v2"``, ``"geneformer-v1"``, ``"scgpt-reference"``); a
:class:`~slafload.data.mixture.Mixture` gets the preset built for each of its sources
(:func:`mixture_preset`, what ``Loader(mixture, tokenizer=name)`` does). See
``docs/fine-tuning.md`` for what is identical to the reference implementations and what is not.

Randomness (scGPT's tie spreading and subsampling) never uses a global or sequential RNG: each
draw is a hash of ``(seed, epoch, stream, cell_integer_id, gene or position)``
(:func:`uniforms`), so a cell gets the same tokens in the same epoch however the epoch is
chunked, batched, sharded or resumed. Stages that need the epoch expose ``for_epoch(epoch)``;
the pipeline (``Pipeline.for_epoch``) binds them at the start of every epoch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from slafload.data.dataset import SlafDataset
from slafload.errors import MixtureError
from slafload.presets.base import (
    DEFAULT_SAMPLE_CELLS,
    DEFAULT_WARN_BELOW,
    Coverage,
    Preset,
    gene_names,
    load_dictionary,
    measure_coverage,
    mixed_preset,
    uniforms,
)

if TYPE_CHECKING:
    from slafload.data.mixture import Mixture

PRESET_NAMES = ("geneformer-v2", "geneformer-v1", "scgpt-reference")


def make_preset(name: str, dataset: SlafDataset, *, seed: int = 0, **options: Any) -> Preset:
    """The preset called ``name`` (one of :data:`PRESET_NAMES`) for ``dataset``.

    ``seed`` keys the random steps of presets that have any (scGPT); the others ignore it.
    """
    if name in ("geneformer-v2", "geneformer-v1"):
        from slafload.presets import geneformer as presets_geneformer

        build = (
            presets_geneformer.geneformer_v2
            if name.endswith("v2")
            else (presets_geneformer.geneformer_v1)
        )
        return build(dataset, **options)
    if name == "scgpt-reference":
        from slafload.presets.scgpt import scgpt

        return scgpt(dataset, seed=seed, **options)
    raise ValueError(f"unknown preset {name!r}; available: {list(PRESET_NAMES)}")


def mixture_preset(
    name: str, mixture: Mixture, *, seed: int = 0, **options: Any
) -> tuple[Mixture, Preset]:
    """``mixture`` tokenized by the preset ``name`` built for every source, and that preset.

    Each source's genes map into the model's own dictionary and its normalisation uses the
    source's own obs columns (Geneformer's ``n_counts``), so a cell's tokens are those the
    preset gives it when its source is loaded alone. The mixture's vocabulary, ``values=``
    handling and remaps are not used; each source's own ``transforms`` run before its
    preset's. The returned preset's tokenizer runs each source's cells through that source's
    preset; its ``sources`` holds the preset of each source (their coverage).

    Raises:
        MixtureError: the mixture has ``values="log1p"`` (the preset normalises every source).
    """
    if mixture.values == "log1p":
        raise MixtureError(
            f"preset {name!r} normalises each source's counts itself; values='log1p' would "
            "normalise them twice: build the Mixture with values='check' (the default)"
        )
    presets = [make_preset(name, ds, seed=seed, **options) for ds in mixture.datasets]
    return mixture.with_presets(presets), mixed_preset(name, mixture.offsets, presets)


__all__: Sequence[str] = [
    "DEFAULT_SAMPLE_CELLS",
    "DEFAULT_WARN_BELOW",
    "PRESET_NAMES",
    "Coverage",
    "Preset",
    "gene_names",
    "load_dictionary",
    "make_preset",
    "measure_coverage",
    "mixture_preset",
    "uniforms",
]
