"""Final answers as text: grpokit.data.answers, where dataset loading (reference answers) and
the rewards both find them. Kept importable from here."""

from grpokit.data.answers import (
    answer_count,
    boxed_contents,
    clean_answer,
    extract_final_answer,
    final_answers,
    gsm8k_reference,
    math_reference,
    reference_boxes,
)

__all__ = ["answer_count", "boxed_contents", "clean_answer", "extract_final_answer", "final_answers",
           "gsm8k_reference", "math_reference", "reference_boxes"]
