"""A reward a tiny random model can learn in a few steps: the fraction of digits in the response."""


def digit_fraction(samples):
    out = []
    for sample in samples:
        text = sample.response
        out.append({"score": sum(c.isdigit() for c in text) / max(len(text), 1), "acc": float(text[:1].isdigit())})
    return out


def starts_with_digit(samples):
    """1 when the response starts with a digit, else 0: a binary reward, so that whole groups often score alike."""
    return [float(sample.response[:1].isdigit()) for sample in samples]
