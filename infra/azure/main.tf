# What the aci backend needs in Azure (backends/README.md):
#   - a resource group for the container groups;
#   - a virtual network with one subnet delegated to Container Instances: the coordinator and every worker
#     get a private IP there, and only QUIC's UDP ports are open inside it;
#   - the coordinator's user-assigned identity, with a custom role on the resource group that allows exactly
#     what the backend calls (create, read, delete container groups, read their logs and operations, join
#     the subnet, and assign the pull identity) and nothing else;
#   - the job store: a storage account and its `jobs` blob container, which the coordinator's identity may
#     read and write (Storage Blob Data Contributor);
#   - optionally, a pull identity with AcrPull on the registry holding the worker image (no registry
#     passwords anywhere).
# `physalia submit` makes each job's coordinator container group itself (cluster mode), with the
# coordinator identity: there is no standing coordinator.

data "azurerm_subscription" "current" {}

resource "azurerm_resource_group" "physalia" {
  name     = var.resource_group_name
  location = var.location
}

resource "azurerm_virtual_network" "physalia" {
  name                = "physalia"
  location            = azurerm_resource_group.physalia.location
  resource_group_name = azurerm_resource_group.physalia.name
  address_space       = [var.vnet_cidr]
}

resource "azurerm_subnet" "workers" {
  name                 = "workers"
  resource_group_name  = azurerm_resource_group.physalia.name
  virtual_network_name = azurerm_virtual_network.physalia.name
  address_prefixes     = [var.subnet_cidr]

  delegation {
    name = "aci"
    service_delegation {
      name    = "Microsoft.ContainerInstance/containerGroups"
      actions = ["Microsoft.Network/virtualNetworks/subnets/action"]
    }
  }
}

# Inside the subnet only the QUIC ports are reachable; nothing comes in from outside the VNet (the workers
# have no public IP). Mutual TLS with the job's CA still decides who may talk (DESIGN invariant 5).
resource "azurerm_network_security_group" "workers" {
  name                = "physalia-workers"
  location            = azurerm_resource_group.physalia.location
  resource_group_name = azurerm_resource_group.physalia.name

  security_rule {
    name                       = "quic-within-subnet"
    priority                   = 100
    direction                  = "Inbound"
    access                     = "Allow"
    protocol                   = "Udp"
    source_port_range          = "*"
    destination_port_range     = var.quic_ports
    source_address_prefix      = var.subnet_cidr
    destination_address_prefix = var.subnet_cidr
  }

  security_rule {
    name                       = "nothing-else-inbound"
    priority                   = 4000
    direction                  = "Inbound"
    access                     = "Deny"
    protocol                   = "*"
    source_port_range          = "*"
    destination_port_range     = "*"
    source_address_prefix      = "*"
    destination_address_prefix = "*"
  }
}

resource "azurerm_subnet_network_security_group_association" "workers" {
  subnet_id                 = azurerm_subnet.workers.id
  network_security_group_id = azurerm_network_security_group.workers.id
}

# The coordinator's identity: azure_identity's ManagedIdentityCredential (feature `azure-identity`) gets
# its ARM tokens when the coordinator runs in Azure with this identity attached.
resource "azurerm_user_assigned_identity" "coordinator" {
  name                = "physalia-coordinator"
  location            = azurerm_resource_group.physalia.location
  resource_group_name = azurerm_resource_group.physalia.name
}

resource "azurerm_role_definition" "aci_launcher" {
  name        = "Physalia ACI launcher (${azurerm_resource_group.physalia.name})"
  scope       = azurerm_resource_group.physalia.id
  description = "What the physalia aci backend calls: container groups, their logs and operations, the worker subnet, the pull identity."

  permissions {
    actions = [
      "Microsoft.ContainerInstance/containerGroups/read",
      "Microsoft.ContainerInstance/containerGroups/write",
      "Microsoft.ContainerInstance/containerGroups/delete",
      "Microsoft.ContainerInstance/containerGroups/containers/logs/read",
      "Microsoft.ContainerInstance/locations/*/read",
      "Microsoft.Network/virtualNetworks/subnets/join/action",
      "Microsoft.ManagedIdentity/userAssignedIdentities/assign/action",
    ]
    not_actions = []
  }

  assignable_scopes = [azurerm_resource_group.physalia.id]
}

resource "azurerm_role_assignment" "coordinator_launches" {
  scope              = azurerm_resource_group.physalia.id
  role_definition_id = azurerm_role_definition.aci_launcher.role_definition_resource_id
  principal_id       = azurerm_user_assigned_identity.coordinator.principal_id
}

# Pulls the worker image from the registry (AciConfig.registry.identity_id).
resource "azurerm_user_assigned_identity" "pull" {
  count               = var.registry_id == null ? 0 : 1
  name                = "physalia-pull"
  location            = azurerm_resource_group.physalia.location
  resource_group_name = azurerm_resource_group.physalia.name
}

resource "azurerm_role_assignment" "pull" {
  count                = var.registry_id == null ? 0 : 1
  scope                = var.registry_id
  role_definition_name = "AcrPull"
  principal_id         = azurerm_user_assigned_identity.pull[0].principal_id
}

# The job store: a storage account with one blob container (`output.dir: az://jobs/PREFIX`, with
# AZURE_STORAGE_ACCOUNT_NAME set to `storage_account`). The coordinator's identity reads and writes job
# records there; so must the user who submits (`Storage Blob Data Contributor` on the account, given
# outside this module: `az role assignment create --assignee <you> --role "Storage Blob Data
# Contributor" --scope <storage_account_id>`). Shared keys are off: every access is an Entra ID token.
resource "azurerm_storage_account" "jobs" {
  name                            = var.storage_account_name
  resource_group_name             = azurerm_resource_group.physalia.name
  location                        = azurerm_resource_group.physalia.location
  account_tier                    = "Standard"
  account_replication_type        = "LRS"
  min_tls_version                 = "TLS1_2"
  shared_access_key_enabled       = false
  allow_nested_items_to_be_public = false
}

resource "azurerm_storage_container" "jobs" {
  name                  = "jobs"
  storage_account_id    = azurerm_storage_account.jobs.id
  container_access_type = "private"
}

resource "azurerm_role_assignment" "coordinator_store" {
  scope                = azurerm_storage_account.jobs.id
  role_definition_name = "Storage Blob Data Contributor"
  principal_id         = azurerm_user_assigned_identity.coordinator.principal_id
}
