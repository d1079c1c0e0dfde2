"""The Python parser of TensorChunk framing reads the golden chunks that the
C++ encoder writes (proto/codec/chunk_codec_test.cc checks the encoder against
the same file)."""
import json
import os
import sys
import unittest

sys.path.insert(0, os.environ["WEIGHTSTORE_PYTHON_CLIENT_DIR"])
sys.path.insert(0, os.environ["WEIGHTSTORE_PYTHON_STUBS_DIR"])
from weightstore_client import client  # noqa: E402

GOLDEN = os.environ["WEIGHTSTORE_CHUNK_GOLDEN"]


class ChunkGoldenTest(unittest.TestCase):
    def test_parses_every_golden_chunk_field_for_field(self):
        with open(GOLDEN) as f:
            chunks = json.load(f)
        self.assertGreaterEqual(len(chunks), 4)
        for expected in chunks:
            chunk = client._parse_chunk(bytes.fromhex(expected["hex"]))
            self.assertEqual(chunk.index, expected["tensor_index"])
            self.assertEqual(chunk.offset, expected["offset"])
            self.assertEqual(chunk.last, expected["last"])
            self.assertEqual(chunk.crc32c, expected["crc32c"])
            self.assertEqual(bytes(chunk.data), bytes.fromhex(expected["data_hex"]))

    def test_refuses_a_truncated_chunk(self):
        with open(GOLDEN) as f:
            first = bytes.fromhex(json.load(f)[0]["hex"])
        with self.assertRaises(client.WeightStoreError) as caught:
            client._parse_chunk(first[:-1])
        self.assertEqual(caught.exception.code, "DATA_LOSS")


if __name__ == "__main__":
    unittest.main()
