"""FTW, edgemoe's pre-merged weight format: expert banks read with direct I/O straight into the host pool.

Modules: :mod:`~edgemoe.weights.ftw.spec` (the format, version 2: files, the bank of packed expert rows,
checksums, the manifest schema and its checks), :mod:`~edgemoe.weights.ftw.direct_io` (parallel ``O_DIRECT`` reads
verified per chunk), :mod:`~edgemoe.weights.ftw.reader` (:func:`load_ftw`),
:mod:`~edgemoe.weights.ftw.writer` (:class:`FTWWriter`, atomic) and
:mod:`~edgemoe.weights.ftw.convert` (:func:`convert`, ``edgemoe convert``).
"""

from edgemoe.weights.ftw.convert import convert
from edgemoe.weights.ftw.reader import FTWLoadStats, load_ftw
from edgemoe.weights.ftw.spec import (
    BANK_FILE,
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    NON_EXPERT_FILE,
    FTWChecksumError,
    FTWConfigError,
    FTWError,
    FTWTruncatedError,
    FTWVersionError,
    Manifest,
    bank_source,
    is_ftw,
    read_manifest,
)
from edgemoe.weights.ftw.writer import FTWWriter

__all__ = [
    "BANK_FILE",
    "FORMAT",
    "FORMAT_VERSION",
    "MANIFEST",
    "NON_EXPERT_FILE",
    "FTWChecksumError",
    "FTWConfigError",
    "FTWError",
    "FTWLoadStats",
    "FTWTruncatedError",
    "FTWVersionError",
    "FTWWriter",
    "Manifest",
    "bank_source",
    "convert",
    "is_ftw",
    "load_ftw",
    "read_manifest",
]
