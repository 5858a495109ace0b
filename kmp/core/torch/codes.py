"""The codes of quantized slots in torch: each code's tables on a device,
and the nearest code to a value (`kmp.core.low_bit.codes`, in torch).

torch runs operations one by one, each a pass over memory, so each code
gets a form of a few operations:

* 8 bits: a look-up keyed on the float's top bits (`codes.code_tables`),
  about eight operations where the elementwise form takes some forty;
* 4 bits: the code's midpoints, searched (`torch.bucketize` eagerly;
  comparisons, which inductor vectorizes, in `kmp.core.torch.compiled`);
* float8: torch's own cast to float8_e4m3fn (round to nearest-even, as
  `codes.nearest_float8`), read as its bytes.

Both torch updates use them: the eager one (`kmp.core.torch.low_precision`)
and the compiled one (`kmp.core.torch.compiled`).
"""

import torch

from kmp.core.low_bit import codes

_TABLES = {}


def tables(code, signed: bool, device):
    """`(values, find, splits)` of `code` on `device`, made once: the
    code's values, and how a value finds its code (8 bits: the candidates
    and splits of `codes.code_tables`; 4 bits: the midpoints, splits None;
    float8: both None)."""
    key = (code.name, signed, str(device))
    if key not in _TABLES:
        values = torch.as_tensor(code.table(signed), device=device)
        find = splits = None
        if code.name == "8bit":
            candidates, split = codes.code_tables(signed)
            find = torch.as_tensor(candidates, device=device)
            splits = torch.as_tensor(split, device=device)
        elif code.name == "4bit":
            table = codes.log_code(signed).astype("float64")
            midpoints = ((table[1:] + table[:-1]) / 2).astype("float32")
            find = torch.as_tensor(midpoints, device=device)
        _TABLES[key] = (values, find, splits)
    return _TABLES[key]


def nearest(normalized, signed: bool, code):
    """The code nearest to each of `normalized` (values divided by their
    block's scale), as int32 (`kmp.core.low_bit.codes.nearest`)."""
    if code.name == "float8":
        return float8_bytes(normalized).int()
    _, find, splits = tables(code, signed, normalized.device)
    if code.name == "4bit":
        return torch.bucketize(normalized, find).int()
    return nearest_dynamic(normalized, signed, find, splits)


def float8_bytes(normalized):
    """`normalized` in float8_e4m3fn (scaled to its largest finite value),
    as uint8 bytes."""
    scaled = torch.clamp(normalized * codes.FLOAT8_MAX, -448.0, 448.0)
    return scaled.to(torch.float8_e4m3fn).view(torch.uint8)


def nearest_dynamic(normalized, signed: bool, candidates, splits):
    """The nearest 8-bit dynamic code, looked up by the float's top bits
    (`codes.code_tables`: a key's candidate, plus one above its split)."""
    magnitude = torch.clamp(torch.abs(normalized), max=1.0)
    key = torch.bitwise_right_shift(
        magnitude.view(torch.int32), codes.DROPPED_BITS
    ).long()
    code = candidates[key]
    code = code + torch.gt(magnitude, splits[key])
    if signed:
        mirrored = torch.clamp(254 - code, min=0)
        code = torch.where(normalized < 0, mirrored, code)
    return code
