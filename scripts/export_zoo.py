"""Write configs/models/<name>.yaml for every zoo entry (or check they are current).

    python scripts/export_zoo.py            # regenerate
    python scripts/export_zoo.py --check    # exit 1 if a file is missing or stale
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pulse.spec_io import save_spec, spec_to_dict
from pulse.yamlio import dump_yaml
from pulse.zoo import ZOO_NAMES, get_spec

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "configs" / "models"


def export(out_dir: Path) -> list[Path]:
    written = []
    for name in ZOO_NAMES:
        path = out_dir / f"{name}.yaml"
        save_spec(get_spec(name), path)
        written.append(path)
    return written


def stale(out_dir: Path) -> list[str]:
    """Entries whose file is missing or differs from what the zoo builds now."""
    bad = []
    for name in ZOO_NAMES:
        path = out_dir / f"{name}.yaml"
        if not path.is_file() or path.read_text() != dump_yaml(spec_to_dict(get_spec(name))):
            bad.append(name)
    return bad


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder")
    parser.add_argument("--check", action="store_true", help="only check the files are up to date")
    args = parser.parse_args(argv)
    if args.check:
        bad = stale(args.out)
        if bad:
            print(f"stale model files in {args.out}: {', '.join(bad)}; run scripts/export_zoo.py")
            return 1
        print(f"{len(ZOO_NAMES)} model files in {args.out} are up to date")
        return 0
    for path in export(args.out):
        spec = get_spec(path.stem)
        print(f"{path}: {spec.num_layers} layers, {len(spec.skips)} skips, {spec.total_params:,} params")
    return 0


if __name__ == "__main__":
    sys.exit(main())
