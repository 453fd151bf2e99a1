"""``tokenmill api``: OpenAI's Batch API served by tokenmill, so that code written for OpenAI's
Batch API runs on one's own SGLang servers.

:mod:`producer.api.server` is the aiohttp application (``/v1/files``, ``/v1/batches``,
``/v1/models``, bearer keys, OpenAI-shaped errors), :mod:`producer.api.files` the files (their
bytes in the result store, their records in Redis), :mod:`producer.api.batches` a batch's record
and its transitions, :mod:`producer.api.lifecycle` what moves a batch along (validation and
enqueue, finalization by the ``openai-batch`` export, cancel, expiry), :mod:`producer.api.cli`
the command. A batch is an ordinary run named by the batch id, with one partition, ``batch``.
"""
