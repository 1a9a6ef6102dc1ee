"""Row forms: what a row of the dataset is, whatever file it came from. A token row
(`token_rows`: `input_ids`, optional `loss_mask`) or a chat row (`chat_rows`: a conversation,
tokenized later by producer/chat.py), either with an `id`; `RowForms` (`forms`) tells which a raw
row is and checks it; a row that can be neither is a `BadRow` (`bad`). File formats are
producer/sources/; nothing here opens a file.
"""

from hsx.producer.rows.bad import BadRow, OnBadRow, set_aside
from hsx.producer.rows.chat_rows import CHAT_FIELDS, ChatRow, chat_columns
from hsx.producer.rows.forms import RowForms, SourceRow
from hsx.producer.rows.token_rows import TOKEN_COLUMNS, DatasetRow

__all__ = [
    "CHAT_FIELDS",
    "TOKEN_COLUMNS",
    "BadRow",
    "ChatRow",
    "DatasetRow",
    "OnBadRow",
    "RowForms",
    "SourceRow",
    "chat_columns",
    "set_aside",
]
