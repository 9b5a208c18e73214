"""WordPiece tokenizers with Hugging Face ``tokenizers`` (Rust): from a
``vocab.txt`` or from a Hugging Face model folder, and back into one.

A folder's own ``tokenizer.json`` wins (it carries the normalizer and the
[CLS]/[SEP] template exactly as the model was trained); otherwise its
``vocab.txt`` is read with the casing the folder declares: ``do_lower_case``
in ``tokenizer_config.json``, else the folder's name ("cased"/"uncased"),
else lower case (BERT's default).
"""

import dataclasses
import json
import os

from hetseq.base.errors import UserError

SPECIAL = {"unk_token": "[UNK]", "sep_token": "[SEP]", "pad_token": "[PAD]",
           "cls_token": "[CLS]", "mask_token": "[MASK]"}


def _library():
    try:
        import tokenizers
    except ImportError:
        raise UserError("BERT tokenization needs Hugging Face tokenizers: pip install tokenizers") \
            from None
    return tokenizers


def load_tokenizer(vocab_path, lowercase=True):
    """A ``BertWordPieceTokenizer`` for a vocab.txt (pretraining preprocessing)."""
    if not os.path.isfile(vocab_path):
        raise UserError(f"vocab {vocab_path} does not exist; pass a WordPiece vocab.txt "
                        "or leave it out to train one")
    return _library().BertWordPieceTokenizer(vocab_path, lowercase=lowercase)


@dataclasses.dataclass
class WordPiece:
    """A tokenizer that encodes sentence pairs as BERT expects them:
    ``[CLS] a [SEP] b [SEP]`` with token types 0 and 1, truncated longest-first."""

    tokenizer: object
    lowercase: bool
    source: str

    @classmethod
    def from_folder(cls, folder):
        tokenizer_json = os.path.join(folder, "tokenizer.json")
        lowercase = _lowercase(folder)
        if os.path.isfile(tokenizer_json):
            try:
                tokenizer = _library().Tokenizer.from_file(tokenizer_json)
            except Exception as err:
                raise UserError(f"{tokenizer_json} is not a tokenizers file ({err}); remove it "
                                "to use the folder's vocab.txt") from None
            return cls(tokenizer, lowercase, tokenizer_json)
        vocab = os.path.join(folder, "vocab.txt")
        if not os.path.isfile(vocab):
            raise UserError(f"{folder} has neither tokenizer.json nor vocab.txt; a BERT model "
                            "folder needs one of them")
        return cls.from_vocab(vocab, lowercase)

    @classmethod
    def from_vocab(cls, vocab, lowercase=True):
        return cls(load_tokenizer(vocab, lowercase), lowercase, vocab)

    def encode_pairs(self, firsts, seconds, max_length):
        """[(input_ids, token_type_ids)] for sentence pairs (``seconds`` None: singles)."""
        tokenizer = self.tokenizer
        tokenizer.no_padding()
        tokenizer.enable_truncation(max_length=max_length)
        inputs = list(firsts) if seconds is None else list(zip(firsts, seconds))
        return [(e.ids, e.type_ids) for e in tokenizer.encode_batch(inputs)]

    def describe(self):
        return f"{self.source} ({'uncased' if self.lowercase else 'cased'})"

    def save(self, folder, model_max_length):
        """vocab.txt, tokenizer.json and tokenizer_config.json: what
        ``AutoTokenizer.from_pretrained(folder)`` reads."""
        vocab = sorted(self.tokenizer.get_vocab().items(), key=lambda item: item[1])
        with open(os.path.join(folder, "vocab.txt"), "w", encoding="utf-8") as f:
            f.write("".join(token + "\n" for token, _ in vocab))
        self.tokenizer.no_truncation()
        self.tokenizer.no_padding()
        self.tokenizer.save(os.path.join(folder, "tokenizer.json"))
        config = {"tokenizer_class": "BertTokenizer", "do_lower_case": self.lowercase,
                  "model_max_length": model_max_length, **SPECIAL}
        for name, content in (("tokenizer_config.json", config),
                              ("special_tokens_map.json", SPECIAL)):
            with open(os.path.join(folder, name), "w", encoding="utf-8") as f:
                json.dump(content, f, indent=2)


def _lowercase(folder):
    config = os.path.join(folder, "tokenizer_config.json")
    if os.path.isfile(config):
        try:
            with open(config, encoding="utf-8") as f:
                value = json.load(f).get("do_lower_case")
            if isinstance(value, bool):
                return value
        except (OSError, ValueError, AttributeError):
            pass
    name = os.path.basename(os.path.normpath(folder)).lower()
    return "uncased" in name or "cased" not in name
