"""FreeScale's own row-wise sharded embedding tables and the prioritized pipeline over them."""
