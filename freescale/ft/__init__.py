"""The fault-tolerant replica layer on torchft: replica groups as fault domains, the lighthouse, the local launcher."""
