"""Edits of a tokenizer.json (its parsed data, in place) that the bad-input tests of several packages share."""

from __future__ import annotations


def pair_type_past_table(data: dict) -> None:
    # BertProcessing's pair as a template whose second text is token type 5, where the table has 2 rows: ONNX
    # Runtime failed such a pair at run time and OpenVINO's Gather read zeros for it (a wrong embedding, no error)
    cls, sep = data["post_processor"]["cls"], data["post_processor"]["sep"]

    def piece(kind, name, type_id):
        return {kind: {"id": name, "type_id": type_id}}
    data["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [piece("SpecialToken", cls[0], 0), piece("Sequence", "A", 0), piece("SpecialToken", sep[0], 0)],
        "pair": [piece("SpecialToken", cls[0], 0), piece("Sequence", "A", 0), piece("SpecialToken", sep[0], 0),
                 piece("Sequence", "B", 5), piece("SpecialToken", sep[0], 5)],
        "special_tokens": {name: {"id": name, "ids": [i], "tokens": [name]} for name, i in (cls, sep)}}
