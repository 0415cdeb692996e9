"""Tests of console/, mirroring its folders."""
